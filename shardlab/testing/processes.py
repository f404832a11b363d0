"""Run a function in N real processes × M simulated devices on 127.0.0.1, as one
jax.distributed run (the machinery of `shardlab launch`), and collect what each returns."""

import importlib
import io
import json
import os
import re
import sys

from shardlab.runtime import launch as launch_lib

RESULT = "shardlab-result: "


def launch(target: str, processes: int = 2, devices_per_process: int = 2,
           timeout_s: float = 120.0) -> list:
  """Calls `target` ("package.module:function", importable in the child processes) in every
  process after jax.distributed starts; returns each rank's JSON-able return value. Fails
  with every process's output if one fails or the deadline passes."""
  out = io.StringIO()
  # The children import what this process can (the test's own folder included).
  path = os.pathsep.join(p for p in sys.path if p)
  code = launch_lib.launch(processes, devices_per_process,
                           [sys.executable, "-m", "shardlab.testing.processes", target],
                           out=out, deadline_s=timeout_s, env={"PYTHONPATH": path})
  text = out.getvalue()
  if code:
    raise AssertionError(f"{target} failed in a {processes}-process run (exit {code}):\n{text}")
  results = {}
  for rank, payload in re.findall(rf"^\[(\d+)\] {RESULT}(.*)$", text, re.M):
    results[int(rank)] = json.loads(payload)
  if sorted(results) != list(range(processes)):
    raise AssertionError(f"not every process returned a result:\n{text}")
  return [results[r] for r in range(processes)]


def _child(target: str) -> None:
  from shardlab.runtime import distributed
  distributed.initialize(None, None, None)  # from the launcher's environment
  module, _, name = target.partition(":")
  if not name:
    raise SystemExit(f"target must be 'module:function', got {target!r}")
  result = getattr(importlib.import_module(module), name)()
  print(RESULT + json.dumps(result), flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  _child(sys.argv[1])
