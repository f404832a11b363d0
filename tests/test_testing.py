"""shardlab.testing on itself: each helper passes on right code and fails, readably, on
wrong code; the plugin sets up devices in a fresh pytest session and refuses a clash."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardlab as sl
from shardlab.testing import assert_collectives, assert_no_replicated_above, assert_placement
from shardlab.testing import assert_sharded_matches_single_device, bytes_per_device
from shardlab.testing import collectives


def rows_sharding(mesh, *spec):
  return NamedSharding(mesh, P(*spec))


def test_matching_and_mismatching_sharded_functions(mesh):
  m = mesh("data:4")
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  total = lambda a: (a * a).sum()
  assert float(assert_sharded_matches_single_device(
      total, x, in_shardings=(rows_sharding(m, "data"),), grad=True)) == float((x * x).sum())

  def local_sum(a):  # forgets to reduce across devices: each keeps its own rows' sum
    return jax.shard_map(lambda b: b.sum(keepdims=True), mesh=m, in_specs=P("data"),
                         out_specs=P("data"))(a)
  with pytest.raises(AssertionError, match=r"sharded outputs differ from one device's: "
                                           r"output: shape \(4, 1\) sharded, \(1, 1\) on one"):
    assert_sharded_matches_single_device(local_sum, x, in_shardings=(rows_sharding(m, "data"),),
                                         reference=lambda a: a.sum(keepdims=True))

  def shifted(a):  # adds each device's position to its rows: a bug the mesh reveals
    return jax.shard_map(lambda b: b + jax.lax.axis_index("data").astype(b.dtype), mesh=m,
                         in_specs=P("data"), out_specs=P("data"))(a)
  with pytest.raises(AssertionError, match=r"output: 24/32 elements differ; worst at "
                                           r"\(6, 0\): sharded 27, one device 24"):
    assert_sharded_matches_single_device(shifted, x, in_shardings=(rows_sharding(m, "data"),),
                                         reference=lambda a: a)


def test_a_correct_tensor_parallel_matmul_passes_by_default(mesh):
  """Its contraction is split over `tensor`, so each output is a sum added in another order:
  outputs near zero (large terms that cancel) move by the terms' rounding, which rtol alone
  does not allow — the default scaled_atol does."""
  m = mesh("data:2,tensor:4")
  rng = np.random.default_rng(0)
  x = (100 * rng.normal(size=(16, 256))).astype(np.float32)
  w = rng.normal(size=(256, 64)).astype(np.float32)
  shardings = (rows_sharding(m, "data", "tensor"), rows_sharding(m, "tensor", None))
  matmul = lambda a, b: a @ b
  assert_sharded_matches_single_device(matmul, x, w, in_shardings=shardings)
  with pytest.raises(AssertionError, match="elements differ"):
    assert_sharded_matches_single_device(matmul, x, w, in_shardings=shardings,
                                         scaled_atol=0.0)


def test_the_message_names_an_element_that_fails(mesh):
  """The largest difference (5, on 1e6: within rtol) is not the failing one (0.1 on 1)."""
  m = mesh("data:2")
  x = np.array([1e6, 1.0], np.float32)
  with pytest.raises(AssertionError, match=r"1/2 elements differ; worst at \(1,\): sharded 1, "
                                           r"one device 0\.8999"):
    assert_sharded_matches_single_device(lambda a: a, x, in_shardings=(rows_sharding(m, "data"),),
                                         reference=lambda a: a - jnp.array([5.0, 0.1]),
                                         scaled_atol=0.0)


def test_placement_and_replication_checks(mesh):
  m = mesh("fsdp:4,tensor:2")
  rules = sl.strategy("fsdp_tp")
  names = {"w": ("embed", "mlp"), "b": ("mlp",)}
  good = {"w": jax.device_put(jnp.ones((64, 32)), rows_sharding(m, "fsdp", "tensor")),
          "b": jax.device_put(jnp.ones(32), rows_sharding(m, "tensor"))}
  assert_placement(good, names, rules, m)
  bad = dict(good, w=jax.device_put(jnp.ones((64, 32)), rows_sharding(m)))
  with pytest.raises(AssertionError, match=r"1 leaves misplaced:\n  \['w'\] \(64, 32\) "
                                           r"\('embed', 'mlp'\): placed \(None, None\), "
                                           r"rules say \('fsdp', 'tensor'\)"):
    assert_placement(bad, names, rules, m)
  # A leaf the names tree lacks is an error, not skipped: "b" replicated would otherwise pass
  # unchecked (the zip of leaves with names stopped at the shorter tree).
  unchecked = dict(good, b=jax.device_put(jnp.ones(32), rows_sharding(m)))
  with pytest.raises(AssertionError, match=r"leaves without names \[\"\['b'\]\"\]"):
    assert_placement(unchecked, {"w": names["w"]}, rules, m)
  assert_no_replicated_above(good, 1000)
  with pytest.raises(AssertionError, match=r"\['w'\] \(64, 32\) float32 \(8,192 bytes\)"):
    assert_no_replicated_above(bad, 1000)
  per_device = bytes_per_device(good)
  assert len(per_device) == 8 and set(per_device.values()) == {64 * 32 * 4 // 8 + 32 * 4 // 2}


def test_collectives_by_kind_and_axis(mesh):
  m = mesh("fsdp:4,tensor:2")
  w = jax.device_put(jnp.ones((64, 32)), rows_sharding(m, "fsdp", "tensor"))
  x = jax.device_put(jnp.ones((16, 64)), rows_sharding(m, "fsdp"))
  gathered = jax.jit(lambda w, x: x @ w,
                     in_shardings=(rows_sharding(m, "fsdp", "tensor"), rows_sharding(m, "fsdp")),
                     out_shardings=rows_sharding(m, "fsdp", "tensor"))
  found = assert_collectives(gathered, w, x, mesh=m, all_gather={"fsdp"},
                             forbid=("all-reduce",))
  # The 64×32 weight, gathered whole along fsdp from 16×16 shards: 64×16 floats per device.
  assert found["all-gather"]["axes"] == {("fsdp",): 64 * 16 * 4}
  assert collectives(gathered.lower(w, x).compile())["all-gather"]["count"] == 1
  summed = jax.jit(lambda x: x.sum(0), in_shardings=(rows_sharding(m, "fsdp"),),
                   out_shardings=rows_sharding(m))
  with pytest.raises(AssertionError, match=r"no all-gather over \('fsdp',\); 1 all-reduce\(s\) "
                                           r"where none may be"):
    assert_collectives(summed, x, mesh=m, all_gather={"fsdp"}, forbid=("all_reduce",))


PLUGIN_TEST = """
import jax

def test_devices(mesh):
    assert jax.device_count() == 4
    assert dict(mesh("data:2,tensor:2").shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert mesh("fsdp:2").devices.size == 2
"""


def test_plugin_sets_up_devices_in_a_fresh_session(pytester):
  pytester.makepyfile(test_user=PLUGIN_TEST)
  result = pytester.runpytest_subprocess("--shardlab-devices", "4", "-p", "no:cacheprovider")
  result.assert_outcomes(passed=1)
  pytester.makeini("[pytest]\nshardlab_devices = 4\n")
  pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_plugin_refuses_a_backend_already_started_with_another_count(pytester):
  pytester.makepyfile(early_jax="import jax\njax.devices()\n",
                      test_user=PLUGIN_TEST)
  pytester.syspathinsert()
  result = pytester.runpytest_subprocess("-p", "early_jax", "--shardlab-devices", "4")
  assert result.ret != 0
  result.stderr.fnmatch_lines(["*shardlab: cannot simulate 4 devices: the JAX backend already "
                               "started with 1 cpu device(s) before the plugin ran*"])
