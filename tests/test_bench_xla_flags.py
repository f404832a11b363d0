"""bench/xla_flags.py's program fingerprint, which decides whether a flag changed the compiled
program: equal for the same program traced from two source files, different when an
instruction differs (the compiles it compares run where CI has no device: a TPU topology, or
GPUs mocked on a GPU)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import xla_flags  # noqa: E402


def _compiled_text(source: str, filename: str) -> str:
  namespace = {"jnp": jnp}
  exec(compile(source, filename, "exec"), namespace)
  return jax.jit(namespace["f"]).lower(jnp.ones((64, 64))).compile().as_text()


def test_the_same_program_from_two_files_has_one_fingerprint():
  a = _compiled_text("def f(x):\n  return jnp.tanh(x @ x).sum()\n", "/one/place.py")
  assert '"/one/place.py"' in a  # the text names the file it was traced from...
  # ...as it would another file (compiled again here, JAX would hand back the first
  # executable: same program), and the fingerprint must not see it.
  b = a.replace('"/one/place.py"', '"/another/place.py"')
  assert xla_flags.fingerprint(a) == xla_flags.fingerprint(b)


def test_a_different_instruction_changes_the_fingerprint():
  a = _compiled_text("def f(x):\n  return jnp.tanh(x @ x).sum()\n", "/p.py")
  b = _compiled_text("def f(x):\n  return jnp.sin(x @ x).sum()\n", "/p.py")
  assert xla_flags.fingerprint(a) != xla_flags.fingerprint(b)
