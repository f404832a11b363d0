"""Inside `mpirun`: the coordinator, the process count and id, and the GPUs of this rank, from
Open MPI's environment alone (no mpi4py).

JAX (0.10) detects Open MPI only through OMPI_MCA_orte_hnp_uri, which Open MPI 4 and older
set (Debian 12 ships 4.1). Open MPI 5 (PRRTE; Debian 13) does not, and JAX then finds no
coordinator at all. Both name the host of `mpirun` to every rank alike: Open MPI 4 in that
URI, Open MPI 5 in the job's PMIx namespace ("prterun-HOST-PID@1"); its PMIX_SERVER_URI*
name each node's own daemon (127.0.0.1 on one host), so they cannot. Process 0 hosts the
coordinator there: run `mpirun` on the host of rank 0 (the first of --host / the hostfile).
"""

import re

from shardlab.runtime import launched

ORTE_URI = "OMPI_MCA_orte_hnp_uri"
# JAX's port range for Open MPI, above Linux's ephemeral ports (32768-60999 by default).
PORT_BASE, PORT_SLOTS = 61440, 4096
ORTE_HOST = re.compile(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]")
PRTE_NAMESPACE = re.compile(r"^prterun-(.+)-(\d+)@\d+$")


Rank = launched.Process  # what this launcher tells one of its processes


def in_run(env) -> bool:
  """Whether this process is one rank of a multi-process `mpirun` (these variables are set
  for each rank it starts, on every node; not by `srun`)."""
  return int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1 and "OMPI_COMM_WORLD_RANK" in env


def launcher(env) -> tuple[str, int, str]:
  """The host of `mpirun`, a port derived from its job, and which variable said so."""
  if ORTE_URI in env:  # Open MPI <= 4: "561250304.0;tcp://10.0.0.1,10.1.0.1:47309;tcp6://..."
    uri = env[ORTE_URI]
    found = ORTE_HOST.search(uri)
    if found is None or not uri.split(".", 1)[0].isdigit():
      raise ValueError(f"{ORTE_URI}={uri!r} names no job id and tcp address")
    job = int(uri.split(".", 1)[0]) // PORT_SLOTS  # job ids are multiples of 2^12
    return next(g for g in found.groups() if g), PORT_BASE + job % PORT_SLOTS, ORTE_URI
  namespace = env.get("PMIX_NAMESPACE", "")  # Open MPI 5
  found = PRTE_NAMESPACE.match(namespace)
  if found is None:
    raise ValueError(f"neither {ORTE_URI} (Open MPI <= 4) nor a PMIX_NAMESPACE of the form "
                     f"'prterun-HOST-PID@N' (Open MPI 5) is set (PMIX_NAMESPACE="
                     f"{namespace!r})")
  host, pid = found.groups()
  return host, PORT_BASE + int(pid) % PORT_SLOTS, "PMIX_NAMESPACE"


def rank(env) -> Rank:
  """This rank's part in the run. JAX_COORDINATOR_ADDRESS (HOST:PORT) or JAX_COORDINATOR_PORT
  override the derived address, as for JAX's own detection."""
  if env.get("JAX_COORDINATOR_ADDRESS"):
    coordinator, source = env["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
  else:
    host, port, source = launcher(env)
    if env.get("JAX_COORDINATOR_PORT"):
      port, source = int(env["JAX_COORDINATOR_PORT"]), "JAX_COORDINATOR_PORT"
    coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  return Rank(coordinator, int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"]),
              local_device_ids(env, launched.visible_gpus(env)), f"from {source}")


def local_device_ids(env, gpus: int) -> list[int] | None:
  """The GPUs (of the `gpus` this rank sees) it drives: an equal share by local rank (8
  visible, 8 ranks on the node: [LOCAL_RANK]; 1 rank: all 8), or all it sees where a
  wrapper gave each rank its own (fewer GPUs than ranks). JAX's own rule gives every rank
  the one GPU [LOCAL_RANK], so one rank per node would drive one GPU of eight."""
  ranks = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "0"))
  if gpus == 0 or "JAX_LOCAL_DEVICE_IDS" in env or ranks < 1:
    return None
  return launched.gpu_share(gpus, ranks, int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
