"""Deaths the kernel reports, seen within a tick on any host: every process keeps one TCP
connection open to process 0, and the kernel closes it when the process ends in any way
(killed, crashed) while its host stays up. Process 0 notes each connection that closes;
the watchdog (watchdog.py) takes a peer whose connection closed before it finished as
dead, as it takes a peer on its own host whose process id is gone.

Why not a shorter heartbeat: a heartbeat thread is Python, and a busy or paused process
(a long call holding the GIL, a full garbage collection of a large heap, swapping, a VM
pause) can miss a few 1 s beats while alive; a closed connection is a fact. A host that
vanishes (power, network) closes nothing: the heartbeat's timeout still finds it.

Nothing here may stop a run: a connection that cannot be made leaves that peer to the
heartbeat alone.
"""

import selectors
import socket
import threading
from typing import Callable

# The heartbeat thread connects: a listener that cannot be reached may not hold it long.
CONNECT_TIMEOUT_S = 1.0


class Listener:
  """Process 0's end: a connection from each other process, which first sends its rank
  and a newline; `on_closed(rank)` runs (on this thread) once a connection ends."""

  def __init__(self, on_closed: Callable[[int], None]):
    dual = socket.has_dualstack_ipv6()  # every address, IPv4 and IPv6, as JAX's service
    self.server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else
                                       socket.AF_INET, backlog=1024, dualstack_ipv6=dual)
    self.port = self.server.getsockname()[1]
    self.on_closed = on_closed
    self._said: dict[socket.socket, bytes] = {}  # what each connection sent so far
    self._selector = selectors.DefaultSelector()  # epoll: no limit of 1024 connections
    self._selector.register(self.server, selectors.EVENT_READ)
    threading.Thread(target=self._run, name="shardlab-liveness", daemon=True).start()

  def _run(self) -> None:
    while True:
      for key, _ in self._selector.select():
        if key.fileobj is self.server:
          conn, _ = self.server.accept()
          self._said[conn] = b""
          self._selector.register(conn, selectors.EVENT_READ)
        else:
          self._read(key.fileobj)

  def _read(self, conn: socket.socket) -> None:
    try:
      data = conn.recv(64)
    except OSError:  # reset: ended as surely as closed
      data = b""
    if data:
      self._said[conn] += data
      return
    self._selector.unregister(conn)
    conn.close()
    rank, newline, _ = self._said.pop(conn).partition(b"\n")
    if newline and rank.isdigit():
      self.on_closed(int(rank))


def connect(address: str, rank: int) -> socket.socket | None:
  """This process's end (kept open until it exits), or None where process 0's listener at
  `address` ("HOST:PORT") cannot be reached."""
  host, _, port = address.rpartition(":")
  try:
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    conn.sendall(f"{rank}\n".encode())
    return conn
  except (OSError, ValueError):
    return None
