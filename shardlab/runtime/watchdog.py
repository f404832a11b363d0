"""Every process of a multi-process run watches the others, so none waits forever on a peer
that died, hangs, or failed with an error.

Each process writes a heartbeat counter into the coordination service's key-value store
once a second and reads everyone's (one RPC each way). A peer whose counter stops for
`timeout_s`, or that reported a failure, stops this process with a message naming the peer
and exit code 4. JAX's own heartbeat (3 × timeout_s, see distributed.py) stays as the
backstop: it aborts every process when the coordinator (process 0) itself dies, which no
thread here can report first, since the connection it would report through is gone.

Process 0 hosts the coordinator, so it leaves last: when it stops, the others' JAX runtime
aborts them; when it waits for them, they stop with this module's message.

A finished process keeps watching until every other one has finished too, so that a peer
that died is named by this module rather than after JAX's shutdown barrier times out (its
own heartbeat, 3 × timeout_s, then SIGABRT). There a peer is also watched by the kernel's
word (liveness.py): on this host its process id, on any host its connection to process 0;
its death is seen within a tick or two, not after timeout_s.
"""

import os
import socket
import sys
import threading
import time

from shardlab.runtime import liveness

PREFIX = "shardlab/watchdog/"
EXIT_CODE = 4  # a peer or the coordinator failed; see docs/guarantees.md
TICK_S = 1.0


class Watchdog:
  """The heartbeat thread of one process (`client`: jax.distributed's runtime client)."""

  def __init__(self, client, rank: int, count: int, coordinator: str, timeout_s: float):
    self.client, self.rank, self.count = client, rank, count
    self.coordinator, self.timeout_s = coordinator, timeout_s
    self.others = [r for r in range(count) if r != rank]
    self._stopped = threading.Event()
    self._failing = False  # this process is exiting with its own error: no second message
    self._last_seen: dict[int, tuple[str | None, float]] = {}
    self._finishing = False  # this process is done and waits for the others
    self._host = socket.gethostname()
    self._link = None  # the connection to process 0's liveness listener (False: none)
    # The console as it is now: while a step compiles, fd 2 points at a file that reads
    # XLA's C++ log (observe/xla_log.py), and a message written there is lost at os._exit.
    try:
      self._console = os.dup(2)
    except OSError:  # no fd 2 at all: nothing to say it on
      self._console = None
    self._thread = threading.Thread(target=self._run, name="shardlab-watchdog", daemon=True)

  def start(self) -> "Watchdog":
    self._thread.start()
    return self

  def _run(self) -> None:
    beat = 0
    self._publish("pid", f"{self._host} {os.getpid()}")
    if self.rank == 0:
      self._link = False  # process 0 listens
      self._listen()
    while not self._stopped.is_set():
      beat += 1
      try:
        self.client.key_value_set(f"{PREFIX}alive/{self.rank}", str(beat), allow_overwrite=True)
        status = dict(self.client.key_value_dir_get(PREFIX))
      except Exception as e:  # the coordinator's connection is gone
        if self._stopped.is_set():
          return
        self._stop_process(f"lost the coordinator (process 0 at {self.coordinator}): "
                           f"{str(e).splitlines()[0][:200]}")
        return
      if self._link is None and f"{PREFIX}link/0" in status:
        self._link = liveness.connect(status[f"{PREFIX}link/0"], self.rank) or False
      problem = self._problem(status, time.monotonic())
      if problem and not self._stopped.is_set():
        self._stop_process(problem)
        return
      self._stopped.wait(TICK_S)

  def _problem(self, status: dict, now: float) -> str | None:
    """What is wrong with the other processes, if anything, from the store's `status`."""
    for rank in self.others:
      failed = status.get(f"{PREFIX}failed/{rank}")
      if failed is not None:
        return f"process {rank} of {self.count} failed ({failed})"
    for rank in self.others:
      if f"{PREFIX}done/{rank}" in status:
        continue
      # Finished, this process waits only for peers: one the kernel says ended is dead.
      # (While training, the heartbeat alone judges: its message is the documented one.)
      death = self._finishing and self._death(status, rank)
      if death:
        return f"process {rank} of {self.count} died ({death}: it crashed or was killed)"
      value = status.get(f"{PREFIX}alive/{rank}")
      seen, since = self._last_seen.get(rank, (None, now))
      if value != seen or rank not in self._last_seen:
        self._last_seen[rank] = (value, now)
      elif now - since > self.timeout_s:
        return (f"process {rank} of {self.count} sent no heartbeat for {now - since:.0f} s "
                f"(--heartbeat-timeout {self.timeout_s:g}): it died, was killed, or hangs")
    return None

  def _death(self, status: dict, rank: int) -> str | None:
    """How peer `rank` is known to have ended without finishing, or None: its process on
    this host is gone, or its connection to process 0 closed (liveness.py)."""
    pid = _local_pid(status.get(f"{PREFIX}pid/{rank}"), self._host)
    if pid is not None and not _alive(pid):
      return f"its process {pid} on this host ended without finishing"
    if f"{PREFIX}closed/{rank}" in status:
      return "its connection to process 0 closed without it finishing"
    return None

  def _listen(self) -> None:
    """Process 0: the liveness listener, its address (the coordinator's host) published."""
    def closed(rank: int) -> None:
      try:
        self.client.key_value_set(f"{PREFIX}closed/{rank}", "1", allow_overwrite=True)
      except Exception:
        pass  # the coordinator is going: the others learn it from JAX's runtime
    try:
      listener = liveness.Listener(closed)
    except OSError:
      return  # the heartbeat alone, then
    self._publish("link", f"{self.coordinator.rpartition(':')[0]}:{listener.port}")

  def _stop_process(self, problem: str) -> None:
    if self._failing:
      return
    what = (f"process {self.rank} had finished its part" if self._finishing else
            f"stopping process {self.rank} too")
    sys.stderr.flush()
    if self._console is not None:
      os.write(self._console, f"error: {problem}; {what} (exit {EXIT_CODE})\n".encode())
    self._publish("failed", f"stopped because {problem}")  # the rest learn it at once
    self._exit(EXIT_CODE)

  def _publish(self, what: str, value: str) -> None:
    try:
      self.client.key_value_set(f"{PREFIX}{what}/{self.rank}", value[:500],
                                allow_overwrite=True)
    except Exception:
      pass  # the coordinator is gone: the others learn it from JAX's runtime

  def _exit(self, code: int) -> None:
    """Leaves now (Python's exit would wait at JAX's shutdown barrier for peers that are
    gone); process 0 first waits, briefly, for the others to go."""
    if self.rank == 0:
      self._wait_for_others(deadline_s=3 * TICK_S + 2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

  def _wait_for_others(self, deadline_s: float) -> None:
    """Until every other process has stopped beating (or finished), at most deadline_s."""
    end, previous = time.monotonic() + deadline_s, None
    while time.monotonic() < end:
      try:
        status = dict(self.client.key_value_dir_get(PREFIX))
      except Exception:
        return
      beats = {r: status.get(f"{PREFIX}alive/{r}") for r in self.others
               if f"{PREFIX}done/{r}" not in status and not self._death(status, r)}
      if not beats or beats == previous:
        return
      previous = beats
      time.sleep(1.5 * TICK_S)

  def await_verdict(self) -> None:
    """Gives the heartbeats time to name a dead or failed peer (which ends this process
    with that message); returns if none is found. For an error from a collective: a peer
    that died mid-step makes it fail here first, naming only a socket."""
    self._thread.join(timeout=self.timeout_s + 2 * TICK_S)

  def fail(self, message: str, code: int) -> None:
    """This process failed: tells the others (they stop with `message`), then exits."""
    self._failing = True
    self._stopped.set()
    self._publish("failed", message)
    self._exit(code)

  def finish(self, wait_s: float = 120.0) -> None:
    """This process is done: the others stop expecting its heartbeat, and it waits (at most
    `wait_s`) for them to finish too, still watching: a peer that died or failed meanwhile
    ends this process with exit 4 naming it, instead of a wait at JAX's shutdown barrier."""
    if self._failing or self._stopped.is_set():
      return
    self._finishing = True
    self._publish("done", "1")
    end = time.monotonic() + wait_s
    while self._thread.is_alive() and time.monotonic() < end and not self._all_done():
      self._stopped.wait(TICK_S / 4)
    self._stopped.set()
    self._thread.join(timeout=5)

  def _all_done(self) -> bool:
    try:
      status = dict(self.client.key_value_dir_get(PREFIX))
    except Exception:
      return True  # the coordinator is gone: JAX's shutdown says the rest
    return all(f"{PREFIX}done/{r}" in status for r in self.others)


def _local_pid(where: str | None, host: str) -> int | None:
  """The process id a peer published ("HOST PID"), if it runs on this host."""
  peer_host, _, pid = (where or "").partition(" ")
  return int(pid) if peer_host == host and pid.isdigit() else None


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except FileNotFoundError:
    return False
  except OSError:  # no /proc here: ask the kernel
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    return True
