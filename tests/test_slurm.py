"""shardlab under a real SLURM: a one-node cluster (munged, slurmctld, slurmd from Debian's
slurm-wlm and munge, started by tests/cluster/slurm_up.sh) shared by the session.

`srun -n2` of train.py equals the 1-process × 8-device run; the script `shardlab launch
--slurm` writes runs under `sbatch --wait` and, requeued mid-run, resumes from its
checkpoint with the same losses; a task killed with SIGKILL stops the step in seconds,
named. .ci/run installs the packages, so CI never skips these. The first tests need no
cluster: the SLURM environment read into a coordinator, process ids and GPUs."""

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from shardlab.runtime import sbatch, slurm
from test_multihost import PY, ROOT, env, losses, single, train_cmd

UP = ROOT / "tests" / "cluster" / "slurm_up.sh"
STEPS = 8
MARK = "SHARDLAB_TEST_SLURM_RUN"  # finds a run's tasks among the host's processes


# ---- the environment of an srun step, read (no cluster) ---------------------------------

@pytest.mark.parametrize("nodelist, first", [
    ("vm", "vm"), ("node7,gpu1", "node7"), ("gpu[003-010]", "gpu003"),
    ("gpu[07,009-012],cpu1", "gpu07"), ("rack[1-2]-gpu[01-04]", "rack1-gpu01"),
    ("a-b[10-11].c", "a-b10.c")])
def test_first_host_of_a_node_list(nodelist, first):
  assert slurm.first_host(nodelist) == first


def test_ports_differ_for_near_jobs_and_steps_of_one_job():
  ports = {slurm.coordinator_port(job, step) for job in range(1000, 1512) for step in range(8)}
  assert len(ports) == 512 * 8 and min(ports) >= 61440 and max(ports) <= 65535


STEP_ENV = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_PROCID": "3",
            "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
            "SLURM_STEP_NODELIST": "gpu[12-13]", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}


def test_an_srun_task_finds_the_coordinator_and_its_gpu():
  task = slurm.task({**STEP_ENV, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
  assert task == slurm.Task(f"gpu12:{slurm.coordinator_port(4242, 1)}", 16, 3, [3],
                            "port from job 4242, step 1")
  assert slurm.in_step(STEP_ENV)
  batch = {k: v for k, v in STEP_ENV.items() if k != "SLURM_STEP_ID"}
  assert not slurm.in_step(batch)  # the batch script itself: one process, not 16
  given = slurm.task({**STEP_ENV, "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
  assert given.coordinator == "10.0.0.1:1234"


@pytest.mark.parametrize("tasks_per_node, gpus, extra, ids", [
    ("8(x2)", 8, {}, [3]),  # one task per GPU, all visible
    ("1(x2)", 8, {}, list(range(8))),  # one task per node: all its GPUs (JAX alone: [0])
    ("2(x2)", 8, {}, [4, 5, 6, 7]),  # an equal share by SLURM_LOCALID (1 here)
    ("8(x2)", 1, {"SLURM_GPUS_PER_TASK": "1"}, [0]),  # srun bound one GPU to each task
    ("8(x2)", 0, {}, None),  # CPU: JAX's default
    ("8(x2)", 8, {"JAX_LOCAL_DEVICE_IDS": "0"}, None)])  # the user's choice: JAX reads it
def test_the_gpus_a_task_drives(tasks_per_node, gpus, extra, ids):
  localid = "1" if tasks_per_node == "2(x2)" else "3"
  env_ = {**STEP_ENV, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": localid,
          **extra}
  assert slurm.local_device_ids(env_, gpus) == ids


def test_the_sbatch_script_for_gpus():
  text = sbatch.script(["python", "train.py", "--checkpoint-dir", "/shared/c"], nodes=4,
                       gpus_per_node=8, per="node", time="12:00:00", partition="h100",
                       sbatch_options=["--account=proj"])
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "#SBATCH --time=12:00:00", "#SBATCH --partition=h100", "#SBATCH --requeue",
               "#SBATCH --signal=B:USR1@120", "#SBATCH --account=proj",
               'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
               "srun python train.py --checkpoint-dir /shared/c &"):
    assert re.search(rf"^{re.escape(line)}( |$)", text, re.M), line
  assert "NCCL_DEBUG" in text and "NCCL_SOCKET_IFNAME" in text and "JAX_PLATFORMS" not in text
  per_gpu = sbatch.script(["python", "train.py"], nodes=2, gpus_per_node=8)
  assert "#SBATCH --ntasks-per-node=8 " in per_gpu


# ---- on a running cluster --------------------------------------------------------------

def _alive(pid_file: Path) -> bool:
  try:
    os.kill(int(pid_file.read_text()), 0)
    return True
  except (OSError, ValueError):
    return False


@pytest.fixture(scope="session")
def cluster():
  """The environment for SLURM's commands, with the cluster up; stopped at the end unless
  it was already running."""
  if shutil.which("slurmctld") is None:
    pytest.skip("SLURM is not installed here: apt-get install -y slurm-wlm munge (.ci/run "
                "installs them, so CI runs these tests)")
  state = Path(os.environ.get("SHARDLAB_SLURM_DIR", "/tmp/shardlab-slurm"))
  was_up = _alive(state / "slurmctld.pid")
  up = subprocess.run(["bash", str(UP), str(state)], capture_output=True, text=True,
                      timeout=120)
  assert up.returncode == 0, up.stdout + up.stderr
  outside = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
  yield {**outside, "SLURM_CONF": str(state / "slurm.conf"), "PYTHONUNBUFFERED": "1"}
  if not was_up:
    subprocess.run(["bash", str(UP), "--down", str(state)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
  """The losses of the same run as one process with 8 devices."""
  metrics = tmp_path_factory.mktemp("reference") / "one.jsonl"
  single(train_cmd(STEPS, "--metrics-file", str(metrics)))
  return losses(metrics)


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 400) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    found = re.search(pattern, log.read_text() if log.exists() else "", re.M)
    if found:
      return found.group(0)
    time.sleep(0.2)
  pytest.fail(f"no {pattern!r} within {timeout} s:\n{log.read_text() if log.exists() else ''}")


def node_name(cluster) -> str:
  return subprocess.run(["sinfo", "--noheader", "--format=%N"], capture_output=True,
                        text=True, env=cluster, check=True).stdout.strip()


@pytest.mark.slow
def test_srun_two_tasks_match_one_process(cluster, reference, tmp_path):
  metrics = tmp_path / "two.jsonl"
  cmd = ["srun", "-N1", "-n2", "--cpus-per-task=1",
         *train_cmd(STEPS, "--simulate-devices", "4", "--metrics-file", str(metrics))]
  started = time.monotonic()
  out = subprocess.run(cmd, capture_output=True, text=True, env=cluster, cwd=ROOT,
                       timeout=400)
  print(f"srun -n2 ran {STEPS} steps in {time.monotonic() - started:.0f} s")
  assert out.returncode == 0, out.stdout + out.stderr
  how = re.search(r"^distributed: SLURM \(detected\), coordinator (\S+):(\d+) \(port from job "
                  r"(\d+), step (\d+)\): process 0 of 2$", out.stdout, re.M)
  assert how, out.stdout
  host, port, job, step = how.groups()
  assert host == node_name(cluster) and int(port) == slurm.coordinator_port(int(job), int(step))
  assert f"step {STEPS}/{STEPS}" in out.stdout and out.stdout.count("held-out loss") == 1
  np.testing.assert_allclose(losses(metrics), reference, rtol=1e-5)


def task_pids(marker: str) -> dict[int, int]:
  """{SLURM_PROCID: pid} of the train.py tasks whose environment carries `marker`."""
  found = {}
  for proc in Path("/proc").glob("[0-9]*"):
    try:
      environ = dict(v.split("=", 1) for v in
                     (proc / "environ").read_text().split("\0") if "=" in v)
      cmdline = (proc / "cmdline").read_text()
    except OSError:
      continue
    if environ.get(MARK) == marker and "SLURM_PROCID" in environ and "train.py" in cmdline:
      found[int(environ["SLURM_PROCID"])] = int(proc.name)
  return found


@pytest.mark.slow
def test_a_killed_task_stops_the_step_naming_it(cluster, tmp_path):
  marker, log = uuid.uuid4().hex, tmp_path / "srun.log"
  with open(log, "w") as out:
    proc = subprocess.Popen(["srun", "-N1", "-n2", *train_cmd(10_000, "--simulate-devices", "4")],
                            stdout=out, stderr=subprocess.STDOUT, env={**cluster, MARK: marker},
                            cwd=ROOT, start_new_session=True)
  try:
    wait_for(log, r"^step ", proc)
    pids = task_pids(marker)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=60)
    seconds = time.monotonic() - killed_at
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      for pid in task_pids(marker).values():
        os.kill(pid, signal.SIGKILL)
  text = log.read_text()
  print(f"srun exited {proc.returncode} {seconds:.1f} s after task 1 was killed")
  assert proc.returncode != 0 and seconds < 30, text
  assert re.search(r"^error: process 1 of 2 sent no heartbeat for \d+ s \(--heartbeat-timeout "
                   r"15\): it died, was killed, or hangs; stopping process 0 too \(exit 4\)",
                   text, re.M), text
  assert re.search(r"srun: error: \S+: task 1: Killed", text), text
  assert not task_pids(marker)


def write_script(cluster, tmp_path: Path, *train_args: str) -> tuple[Path, Path]:
  """`shardlab launch --slurm` for 1 node × 2 tasks, each with 4 CPU devices."""
  script, log = tmp_path / "job.sh", tmp_path / "job.log"
  subprocess.run([PY, "-m", "shardlab.cli", "launch", "--slurm", "--nodes", "1",
                  "--gpus-per-node", "2", "--cpu-devices", "4", "--output", str(log),
                  "--script", str(script), "--", *train_cmd(STEPS, *train_args)],
                 check=True, env=cluster, cwd=ROOT, capture_output=True)
  return script, log


@pytest.mark.slow
def test_a_requeued_job_resumes_from_its_checkpoint(cluster, reference, tmp_path):
  """One job under `sbatch --wait`, preempted twice: by its time limit (the script's SIGUSR1:
  it sends the tasks SIGTERM, then requeues the job), then by `scontrol requeue` (SLURM sends
  every task SIGTERM). Each time the tasks save the same step and the job resumes there;
  the losses equal an uninterrupted run's. Both signals come before the step compiles: the
  tasks stop at the first step after it (the cluster's KillWait leaves them time to)."""
  ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
  script, log = write_script(cluster, tmp_path, "--checkpoint-dir", str(ckpt),
                             "--metrics-file", str(metrics))
  started = time.monotonic()
  job = subprocess.Popen(["sbatch", "--wait", "--parsable", str(script)], env=cluster,
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
  job_id = None
  try:
    job_id = wait_for(log, r"(?<=^shardlab: job )\d+", job)
    wait_for(log, r"^distributed: SLURM", job)  # JAX now turns SIGTERM into a save
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=cluster, check=True)
    wait_for(log, r"\(restart 1\)[\s\S]*^distributed: SLURM", job)
    subprocess.run(["scontrol", "requeue", job_id], env=cluster, check=True)
    out, _ = job.communicate(timeout=600)
  finally:
    if job.poll() is None:
      job.kill()
      if job_id:
        subprocess.run(["scancel", job_id], env=cluster)
  text = log.read_text()
  print(f"the job, preempted twice, finished {time.monotonic() - started:.0f} s after "
        f"submission")
  assert job.returncode == 0, out + text
  saved = [int(s) for s in re.findall(r"^received SIGTERM: stopped after step (\d+); checkpoint "
                                      r"saved at step \1 in ", text, re.M)]
  assert len(saved) == 2 and 1 <= saved[0] < saved[1] < STEPS, text
  assert text.count(f"shardlab: saved; requeueing job {job_id}") == 1  # the time limit's
  for restart, step in enumerate(saved, 1):
    assert f"shardlab: job {job_id} (restart {restart})" in text
    assert f"resuming from the checkpoint at step {step} in {ckpt}" in text
  assert text.count(f"step {STEPS}/{STEPS} ") == 1
  np.testing.assert_allclose(losses(metrics), reference, rtol=1e-5)
