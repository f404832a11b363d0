"""Multi-controller runs: one process per host (or per GPU), all running the same program.

`initialize` starts jax.distributed either from explicit arguments (--coordinator, set by
`shardlab launch` through SHARDLAB_* variables), from an `srun` step's environment (slurm.py)
or an `mpirun` rank's (open_mpi.py), or from the cluster JAX detects (TPU pod slices). It
must run before the backend starts. Nothing waits without a deadline: joining has
`--init-timeout`, and afterwards a watchdog stops every process when one dies, hangs or fails
(watchdog.py); each such exit is code 4 with a message naming the process or the
coordinator. A coordinator port already in use is refused before JAX tries
it (exit 2, naming the port): JAX's own failure there is a native crash.
"""

import atexit
import errno
import os
import socket
import sys
import threading

import jax

from shardlab.bounds import Float
from shardlab.errors import ConfigError
from shardlab.runtime import jax_compat, open_mpi, slurm, watchdog

# Set by `shardlab launch` for each process it starts; the CLI reads them as defaults.
ENV_COORDINATOR = "SHARDLAB_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDLAB_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDLAB_PROCESS_ID"

INIT_TIMEOUT_S = 90  # all processes must join within this (--init-timeout)
HEARTBEAT_TIMEOUT_S = 15  # a peer silent this long is taken as dead (--heartbeat-timeout)
# How long a finishing process waits at exit for the others to finish too: long enough for
# process 0's last writes (metrics, plot), short enough not to look like a hang.
SHUTDOWN_TIMEOUT_S = 120
_watchdog: watchdog.Watchdog | None = None


def detected_cluster() -> str | None:
  """The kind of multi-process launch we are inside, from the environment, or None."""
  env = os.environ
  # mpirun's ranks first: in a SLURM allocation they may carry an srun step's variables too
  # (Open MPI starts its daemons on the other nodes with srun), but only mpirun sets OMPI_*.
  if open_mpi.in_run(env):
    return "Open MPI"
  if slurm.in_step(env):
    return "SLURM"
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in env:
    return "TPU pod"
  return None


# initialize()'s timeouts, and train.py's --init-timeout and --heartbeat-timeout.
INIT_TIMEOUT = Float(min=1, note="seconds")
HEARTBEAT_TIMEOUT = Float(min=2, note="seconds; heartbeats are 1 s apart")


def _check_timeouts(init_timeout_s: float, heartbeat_timeout_s: float) -> None:
  INIT_TIMEOUT.check(init_timeout_s, "--init-timeout")
  HEARTBEAT_TIMEOUT.check(heartbeat_timeout_s, "--heartbeat-timeout")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, init_timeout_s: float = INIT_TIMEOUT_S,
               heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> str | None:
  """Starts jax.distributed if this is a multi-process run; returns how, or None. Every
  process must join within `init_timeout_s`, else this one exits 4 naming the coordinator;
  afterwards a peer silent for `heartbeat_timeout_s` (or failed) stops it (watchdog.py)."""
  _check_timeouts(init_timeout_s, heartbeat_timeout_s)
  coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
  if num_processes is None and ENV_NUM_PROCESSES in os.environ:
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in os.environ:
    process_id = int(os.environ[ENV_PROCESS_ID])
  if coordinator is None:
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ConfigError("--num-processes/--process-id need --coordinator HOST:PORT")
    cluster = detected_cluster()
    if cluster is None:
      return None
    readers = {"SLURM": slurm.task, "Open MPI": open_mpi.rank}
    if cluster in readers:
      return _start_launched(cluster, readers[cluster], init_timeout_s, heartbeat_timeout_s)
    _start(init_timeout_s, heartbeat_timeout_s, f"the coordinator {cluster} names")
    return f"{cluster} (detected): process {jax.process_index()} of {jax.process_count()}"
  if num_processes is None or process_id is None:
    raise ConfigError("--coordinator needs --num-processes N and --process-id I")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process-id {process_id} must be in [0, {num_processes})")
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
  if process_id == 0 and port_in_use(int(port)):
    raise ConfigError(
        f"--coordinator {coordinator}: port {port} is already in use on this host (another "
        f"run's coordinator, or another program, listens there); process 0 hosts the "
        f"coordinator on it. Choose a free port for every process (`shardlab launch` picks "
        f"one when --port is left out), or stop what uses it")
  _use_gloo_on_cpu()
  _start(init_timeout_s, heartbeat_timeout_s, coordinator, num_processes, process_id)
  return f"{coordinator}: process {process_id} of {num_processes}"


def _use_gloo_on_cpu() -> None:
  if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
    # CPU devices in different processes talk through gloo (tests, laptops).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


# Launchers that start every process themselves: what the process is inside, what its
# processes are called, and how a variable reaches all of them.
LAUNCHED = {"SLURM": ("an srun step", "task", "export it before srun"),
            "Open MPI": ("mpirun", "rank", "mpirun -x JAX_COORDINATOR_PORT")}


def _start_launched(name: str, read, init_timeout_s: float, heartbeat_timeout_s: float) -> str:
  """One process a launcher started (slurm.py, open_mpi.py read its environment): the
  coordinator on process 0's host, the process count and id, its GPUs."""
  inside, each, export = LAUNCHED[name]
  try:
    proc = read(os.environ)
  except (KeyError, ValueError) as e:
    raise ConfigError(f"inside {inside}, but its environment does not say where process 0 "
                      f"is: {e}; set JAX_COORDINATOR_ADDRESS=HOST:PORT for every {each}")
  port = proc.coordinator.rpartition(":")[2]
  if proc.process_id == 0 and port.isdigit() and port_in_use(int(port)):
    raise ConfigError(
        f"{name} coordinator {proc.coordinator} ({proc.source}): port {port} is already in "
        f"use on this host (another run's coordinator, or another program); set "
        f"JAX_COORDINATOR_PORT to a free port for every {each} ({export})")
  _use_gloo_on_cpu()
  _start(init_timeout_s, heartbeat_timeout_s, proc.coordinator, proc.num_processes,
         proc.process_id, proc.local_device_ids, from_slurm=name == "SLURM")
  return (f"{name} (detected), coordinator {proc.coordinator} ({proc.source}): process "
          f"{proc.process_id} of {proc.num_processes}")


def _start(init_timeout_s: float, heartbeat_timeout_s: float, coordinator: str,
           num_processes: int | None = None, process_id: int | None = None,
           local_device_ids: list[int] | None = None, from_slurm: bool = False) -> None:
  """jax.distributed.initialize under our deadline, then the watchdog. JAX's own timeouts
  are longer, as backstops: its init error and its heartbeat abort print native stacks."""
  timer = threading.Timer(init_timeout_s, _init_timed_out,
                          (coordinator, num_processes, process_id, init_timeout_s, from_slurm))
  timer.daemon = True
  timer.start()
  explicit = {} if num_processes is None else dict(
      coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
      local_device_ids=local_device_ids)
  try:
    jax.distributed.initialize(**explicit, initialization_timeout=int(init_timeout_s) + 30,
                               heartbeat_timeout_seconds=int(3 * heartbeat_timeout_s),
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
  finally:
    timer.cancel()
  state = jax_compat.distributed_state()
  global _watchdog
  _watchdog = watchdog.Watchdog(state.client, jax.process_index(), jax.process_count(),
                                state.coordinator_address or coordinator,
                                heartbeat_timeout_s).start()
  # Runs before JAX's own shutdown (registered earlier): a finished process waits there
  # for the others, watching them (watchdog.py), not at JAX's barrier.
  atexit.register(_watchdog.finish, SHUTDOWN_TIMEOUT_S)
  previous = sys.excepthook

  def excepthook(kind, value, tb):  # an error no one caught, e.g. from a collective
    if kind is not KeyboardInterrupt:  # a dead peer is the likelier story: name it instead
      print(f"process {jax.process_index()}: {kind.__name__}: {str(value)[:200]}; checking "
            f"the other processes (up to {heartbeat_timeout_s + 2:g} s) before exiting",
            file=sys.stderr, flush=True)
      _watchdog.await_verdict()
    previous(kind, value, tb)
    fail(f"{kind.__name__}: {str(value)[:300]}", 130 if kind is KeyboardInterrupt else 1)

  sys.excepthook = excepthook


def _init_timed_out(coordinator: str, num_processes, process_id, timeout_s: float,
                    from_slurm: bool = False) -> None:
  """Says which process waited for what, then exits: jax.distributed.initialize would
  otherwise block until JAX's own (longer) deadline, and then abort with a native stack."""
  n = num_processes if num_processes is not None else "all"
  if from_slurm:  # srun started every task: the question is only who could not join
    reached = process_id == 0 or _answers(coordinator)
    what = (f"SLURM task {process_id}: not all {n} tasks of the step joined the coordinator "
            f"at {coordinator} within {timeout_s:g} s" + ("" if reached else
            " (nothing answers there from this node: check that the first node's name "
            "resolves here, or set JAX_COORDINATOR_ADDRESS=HOST:PORT)"))
  elif process_id == 0:
    ids = "1" if n == 2 else f"1..{n - 1}"
    what = (f"process 0 hosts the coordinator at {coordinator}, but not all {n} processes "
            f"joined within {timeout_s:g} s: start the others with --coordinator "
            f"{coordinator} --num-processes {n} and --process-id {ids}")
  elif process_id is None:
    what = f"not all processes of the run reached {coordinator} within {timeout_s:g} s"
  elif _answers(coordinator):
    what = (f"process {process_id} reached the coordinator at {coordinator}, but not all {n} "
            f"processes joined within {timeout_s:g} s: start every process with "
            f"--num-processes {n} and its own --process-id")
  else:
    what = (f"process {process_id} could not reach the coordinator at {coordinator} within "
            f"{timeout_s:g} s (nothing answers there): start process 0 with the same "
            f"--coordinator, and check that this host can reach that host and port")
  print(f"error: jax.distributed did not start: {what}; or raise --init-timeout "
        f"(exit {watchdog.EXIT_CODE})", file=sys.stderr, flush=True)
  os._exit(watchdog.EXIT_CODE)


def port_in_use(port: int) -> bool:
  """Whether something on this host holds `port`, on any address (the coordinator listens
  on all of them). SO_REUSEADDR, as the coordinator's server sets it: a port left in
  TIME_WAIT by an earlier run is free."""
  for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
          s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((wildcard, port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return True  # anything else (no IPv6 here, a bad port): JAX will say
  return False


def _answers(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except (OSError, ValueError):
    return False


def fail(message: str, code: int) -> None:
  """In a multi-process run, ends this process with `code` after telling the others (they
  stop at once, naming this process and `message`); otherwise does nothing."""
  if _watchdog is not None:
    _watchdog.fail(message, code)


def coordinated_preemption() -> bool:
  """Whether SIGTERM goes through JAX's preemption sync manager: a multi-process run."""
  return jax.process_count() > 1 and \
      jax_compat.distributed_state().preemption_sync_manager is not None


def shutdown() -> None:
  """Ends a multi-process run from this process's side: the watchdog first (its next
  heartbeat would find the coordinator gone), then jax.distributed."""
  if _watchdog is not None:
    _watchdog.finish()
  jax.distributed.shutdown()


def is_leader() -> bool:
  """Process 0: the one that prints, writes metrics and makes directories."""
  return jax.process_index() == 0
