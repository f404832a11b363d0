"""Open MPI: `mpirun -n 2 python train.py` as a real 2-process run (Debian's openmpi-bin,
installed by .ci/run), equal to the 1-process run on the same mesh; and where the ranks find
their coordinator under Open MPI 4 and 5."""

import os
import shutil
import socket
import subprocess

import numpy as np
import pytest
from jax._src.clusters import ompi_cluster

from shardlab.errors import ConfigError
from shardlab.runtime import distributed, open_mpi
from test_multihost import ROOT, env, losses, single, train_cmd

MPIRUN = shutil.which("mpirun")
# As root (CI, containers) Open MPI refuses to start without these; 2 ranks may exceed the
# cores Open MPI counts as slots (--oversubscribe), and each rank's 4 simulated devices need
# more than the one core it would bind a rank to (--bind-to none).
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN_ARGS = ["-n", "2", "--oversubscribe", "--bind-to", "none"]

# What Open MPI 4.1.4 (Debian 12) and 5.0.11 set for rank 1 of `mpirun -n 2` on host "vm".
OMPI4 = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_MCA_orte_hnp_uri": "561250304.0;tcp://192.0.2.2:47309;tcp6://[fd00::2]:56785"}
OMPI5 = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "PMIX_NAMESPACE": "prterun-vm-24654@1",
         "PMIX_SERVER_URI41": "prterun-vm-24654@0.0;tcp4://127.0.0.1:60705"}


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_two_processes_match_one_process(tmp_path):
  extra = ["--sample-tokens", "0", "--metrics-file"]
  cmd = [MPIRUN, *MPIRUN_ARGS, *train_cmd(3, *extra, str(tmp_path / "two.jsonl"),
                                          "--simulate-devices", "4")]
  out = subprocess.run(cmd, capture_output=True, text=True, env={**env(), **ROOT_OK},
                       cwd=ROOT, timeout=400)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "distributed: Open MPI (detected), coordinator " in out.stdout
  assert "process 0 of 2" in out.stdout
  assert "on 8 cpu device(s) in 2 processes" in out.stdout
  single(train_cmd(3, *extra, str(tmp_path / "one.jsonl")))
  two, one = losses(tmp_path / "two.jsonl"), losses(tmp_path / "one.jsonl")
  assert len(two) == len(one) == 3
  np.testing.assert_allclose(two, one, rtol=1e-4)


def test_open_mpi_4_coordinator_is_jaxs(monkeypatch):
  for key, value in OMPI4.items():
    monkeypatch.setenv(key, value)
  monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
  rank = open_mpi.rank(OMPI4)
  assert rank.coordinator == ompi_cluster.OmpiCluster.get_coordinator_address(None, None)
  assert (rank.num_processes, rank.process_id) == (2, 1)


def test_open_mpi_5_coordinator_is_mpiruns_host():
  rank = open_mpi.rank(OMPI5)  # not the PMIx server URI's 127.0.0.1: each node's own daemon
  assert rank.coordinator == f"vm:{61440 + 24654 % 4096}"
  assert (rank.num_processes, rank.process_id, rank.source) == (2, 1, "from PMIX_NAMESPACE")
  dashed = {**OMPI5, "PMIX_NAMESPACE": "prterun-gpu-node-07-31337@1"}
  assert open_mpi.rank(dashed).coordinator == f"gpu-node-07:{61440 + 31337 % 4096}"
  assert open_mpi.rank({**OMPI5, "JAX_COORDINATOR_PORT": "7000"}).coordinator == "vm:7000"
  given = {**OMPI5, "JAX_COORDINATOR_ADDRESS": "10.0.0.1:7001"}
  assert open_mpi.rank(given).coordinator == "10.0.0.1:7001"


@pytest.mark.parametrize("gpus,ranks,local,expected", [
    (8, 8, 3, [3]), (8, 1, 0, list(range(8))), (8, 2, 1, [4, 5, 6, 7]),
    (1, 8, 5, [0]), (0, 2, 1, None), (6, 4, 1, None)])
def test_local_device_ids(gpus, ranks, local, expected):
  env_ = {"OMPI_COMM_WORLD_LOCAL_SIZE": str(ranks), "OMPI_COMM_WORLD_LOCAL_RANK": str(local)}
  assert open_mpi.local_device_ids(env_, gpus) == expected
  assert open_mpi.local_device_ids({**env_, "JAX_LOCAL_DEVICE_IDS": "0"}, gpus) is None


def test_mpirun_wins_over_the_srun_step_of_its_daemons(monkeypatch):
  # Inside a SLURM allocation Open MPI starts its remote daemons with srun: their ranks see
  # that step's SLURM_* too, which name the daemons, not the ranks.
  slurm_step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
  for key, value in {**slurm_step, **OMPI5}.items():
    monkeypatch.setenv(key, value)
  assert distributed.detected_cluster() == "Open MPI"


def test_unreadable_environment_is_a_config_error(monkeypatch):
  for key in [k for k in os.environ if k.startswith(("SHARDLAB_", "SLURM_", "PMIX_", "OMPI_"))]:
    monkeypatch.delenv(key)
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
  with pytest.raises(ConfigError, match="PMIX_NAMESPACE.*JAX_COORDINATOR_ADDRESS"):
    distributed.initialize()


def test_rank_0_refuses_a_port_in_use(monkeypatch):
  for key in [k for k in os.environ if k.startswith(("SHARDLAB_", "SLURM_", "PMIX_", "OMPI_"))]:
    monkeypatch.delenv(key)
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  with socket.socket() as taken:
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for key, value in {**OMPI5, "OMPI_COMM_WORLD_RANK": "0",
                       "JAX_COORDINATOR_PORT": str(port)}.items():
      monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=f"vm:{port} .*port {port} is already in use"):
      distributed.initialize()
