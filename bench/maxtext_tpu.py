"""MaxText's own ahead-of-time compile of a training recipe for a TPU topology, read the way
bench/plan_tpu.py reads shardlab's: per-chip memory from the compiled program, and the TPU
compiler's estimated compute cycles summed over the step's optimised HLO
(shardlab.observe.hlo_cycles), which XLA dumps for it. Runs through
../shared/peers/maxtext/run.sh compile-tpu (MaxText's venv, libtpu; no TPU needed)."""

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from peer import RUN_SH, maxtext_available
from shardlab.observe import hlo_cycles

__all__ = ["compile_recipe", "maxtext_available"]

# The compiled program's memory_analysis(), as MaxText's train_compile prints it.
_FIELDS = ("argument", "output", "alias", "temp")
_MEMORY = {f: re.compile(rf"\b{f}_size_in_bytes=(\d+)") for f in _FIELDS}
_HOST = {f: re.compile(rf"\bhost_{f}_size_in_bytes=(\d+)") for f in _FIELDS}


def _train_step_hlo(dump: Path) -> str:
  """The final HLO of the largest program XLA dumped, the train step (MaxText also compiles
  small helper programs): the "after_codegen" text, the one that carries the estimated
  cycles, as `compiled.as_text()` does (the "after_optimizations" one has none)."""
  files = sorted(dump.glob("*after_codegen.txt"), key=lambda p: p.stat().st_size)
  if not files:
    raise RuntimeError(f"XLA dumped no codegen HLO into {dump}")
  return files[-1].read_text()


# What this process's JAX and libtpu set for its own compiles, which MaxText's (its own jax
# and libtpu) must not inherit: TPU_LIBRARY_PATH points at this venv's libtpu, whose older
# version then fails MaxText's splash kernel ("no such field: 'debug_locations'") and
# compiles the rest with another compiler than MaxText's own.
_OURS = ("TPU_", "JAX_", "XLA_", "LIBTPU", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def compile_recipe(topology: str, keys: list[str], libtpu_flags=()) -> dict:
  """MaxText's train_compile for `topology` ("v5e-256") with its config `keys`
  ("model_name=llama2-7b", ...) and the recipe's TPU compiler flags (its `xla_flags`, which
  MaxText's launcher puts in LIBTPU_INIT_ARGS): per-chip bytes (device and host), estimated
  cycles and compile seconds."""
  with tempfile.TemporaryDirectory() as tmp:
    dump = Path(tmp) / "xla"
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OURS)}
    env["XLA_FLAGS"] = f"--xla_dump_to={dump}"
    if libtpu_flags:
      env["LIBTPU_INIT_ARGS"] = " ".join(libtpu_flags)
    start = time.perf_counter()
    done = subprocess.run(["bash", str(RUN_SH), "compile-tpu", f"compile_topology={topology}",
                           *keys], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    found = {f: _MEMORY[f].search(done.stdout) for f in _FIELDS}
    if not all(found.values()):
      raise RuntimeError(f"MaxText's compile for {topology} {' '.join(keys)} printed no "
                         f"memory (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    argument, output, alias, temp = (int(found[f].group(1)) for f in _FIELDS)
    host = {f: int(m.group(1)) if (m := _HOST[f].search(done.stdout)) else 0 for f in _FIELDS}
    return {"total_bytes": argument + output - alias + temp,
            "host_bytes": host["argument"] + host["output"] - host["alias"] + host["temp"],
            "cycles": hlo_cycles.estimated_cycles(_train_step_hlo(dump)),
            "compile_s": seconds}
