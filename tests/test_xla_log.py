"""XLA's involuntary-rematerialisation warnings, caught around a compile and said in one line
naming the layout (the partitioner's screenful kept in the run dir's xla.log)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab.observe import xla_log


def _reshard_program(width: int):
  """A tensor whose 4 rows are split 8 ways (padded), then wanted split along its last dim
  over 4 of those devices: the partitioner can only gather it whole. Each test its own
  `width`: jax reuses a compiled program, and a reused one logs nothing."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def f(a):
    a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(("data", "fsdp"))))
    return jax.lax.with_sharding_constraint(jnp.tanh(a), NamedSharding(mesh, P(None, None,
                                                                               "fsdp")))
  return jax.jit(f).lower(jnp.ones((4, 128, width)))


def test_a_compile_s_rematerialisation_is_one_line_naming_the_layout(tmp_path, capfd):
  said = []
  with xla_log.quiet_remat("fsdp on data:2,fsdp:4", str(tmp_path), said.append):
    _reshard_program(128).compile()
  err = capfd.readouterr().err
  assert "Involuntary" not in err  # the screenful is not on the console ...
  assert "Involuntary full rematerialization" in (tmp_path / "xla.log").read_text()  # but kept
  (line,) = said
  assert "under fsdp on data:2,fsdp:4" in line and "1 tensor(s)" in line
  assert "f32[1,128,128]" in line and str(tmp_path / "xla.log") in line


def test_without_the_capture_xla_prints_it_raw(capfd):
  """The case above is real: uncaught, the partitioner's C++ warning reaches stderr."""
  _reshard_program(64).compile()
  assert "Involuntary full rematerialization" in capfd.readouterr().err


def test_other_output_passes_on_and_nothing_is_said_without_a_remat(tmp_path, capfd):
  said = []
  with xla_log.quiet_remat("dp on data:8", str(tmp_path), said.append):
    jax.jit(lambda x: x + 1).lower(jnp.ones(8)).compile()
    import os
    os.write(2, b"I0101 00:00:00.000000 1 other.cc:1] unrelated\n")
  assert said == [] and not (tmp_path / "xla.log").exists()
  assert "unrelated" in capfd.readouterr().err


def test_a_failed_compile_passes_its_log_on(capfd):
  import os
  try:
    with xla_log.quiet_remat("x", None, print):
      os.write(2, b"E0101 00:00:00.000000 1 x.cc:1] the reason\n")
      raise RuntimeError("compile failed")
  except RuntimeError:
    pass
  assert "the reason" in capfd.readouterr().err
