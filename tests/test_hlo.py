"""The product's HLO parser (shardlab.observe.hlo, hlo_groups) against groups written out by
hand, and against small programs compiled for the 8 simulated CPU devices and, where libtpu
is installed, for a TPU v5e 2x4 topology: the collectives found, the mesh axes they span and
their bytes are derived by hand from the shapes."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardlab.observe import hlo, hlo_groups

F32 = 4
ALL8 = (tuple(range(8)),)

# ---- replica groups, every form XLA prints ---------------------------------------------


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true",
     ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups={}", ALL8),
    ("channel_id=3, to_apply=%add", ALL8),  # no groups at all: every device
    # iota: [groups, size] <= iota(dims), transposed by T(perm)
    ("replica_groups=[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=[1,8]<=[8]", ALL8),
    # mesh axes: the device grid, each group varying along the listed axes
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", ALL8),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
     ((0, 4), (1, 5), (2, 6), (3, 7))),
    # grid [[0,2,4,6],[1,3,5,7]] (iota [4,2] transposed); groups vary along axis_0
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
    # grid rows [0,2],[1,3],[4,6],[5,7] (iota [2,2,2] with its last two dims swapped)
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}",
     ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=(0,2,1,3,4,6,5,7) {'axis_0'}",
     ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("replica_groups=mesh[a=2,b=4] {b}", ((0, 1, 2, 3), (4, 5, 6, 7))),  # names unquoted
    # sub-axes 'x':(pre)size: x=8 cut as [pre, size, rest], the group along `size`
    ("replica_groups=mesh['x'=8] {'x':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("replica_groups=mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    # Several axes: XLA orders a group's members by mesh axis, whatever the listed order.
    ("replica_groups=mesh['a'=2,'b'=2,'c'=2] {'c','a'}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    # collective-permute: one (source, target) pair per group
    ("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", ((0, 1), (1, 2), (2, 3), (3, 0))),
    ("source_target_pairs={}", ()),
])
def test_replica_group_forms(attrs, groups):
  assert hlo_groups.replica_groups(attrs, 8) == groups


def test_an_unknown_group_form_is_an_error_not_a_guess():
  with pytest.raises(ValueError, match="cannot parse"):
    hlo_groups.replica_groups("replica_groups=ring(0->1->2)", 8)
  with pytest.raises(ValueError, match="cannot parse"):
    hlo_groups.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'c'}", 8)


def test_counting_does_not_need_the_groups():
  """Bytes and counts stand without the groups, so a group form this parser does not know
  fails only where the groups are asked for."""
  text = ("HloModule m, num_partitions=4\n\nENTRY %main (a: f32[4,8]) -> f32[16,8] {\n"
          "  %a = f32[4,8]{1,0} parameter(0)\n"
          "  ROOT %ag = f32[16,8]{1,0} all-gather(%a), channel_id=1, "
          "replica_groups=ring(0->1->2->3), dimensions={0}\n}\n")
  (op,) = hlo.collective_ops(text)
  assert (op.op, op.shapes, op.operand_shapes, op.dimensions, op.bytes, op.n_devices) == (
      "all-gather", ((16, 8),), ((4, 8),), (0,), 16 * 8 * F32, 4)
  assert hlo.collectives(text)["all-gather"] == hlo.Collective(count=1, bytes=512, ops=1)
  with pytest.raises(ValueError, match="cannot parse"):
    op.groups


def test_device_count_comes_from_the_module_header():
  assert hlo_groups.device_count("HloModule m, num_partitions=8\n\nENTRY ...") == 8
  assert hlo_groups.device_count("HloModule m, replica_count=2, num_partitions=4\n") == 8
  assert hlo_groups.device_count("HloModule m\n") == 1


def test_mesh_axes_reads_ids_as_positions_in_the_mesh():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  assert hlo_groups.mesh_axes(((0, 1, 2, 3), (4, 5, 6, 7)), mesh) == ("model",)
  assert hlo_groups.mesh_axes(((0, 4), (1, 5), (2, 6), (3, 7)), mesh) == ("data",)
  assert hlo_groups.mesh_axes(ALL8, mesh) == ("data", "model")
  assert hlo_groups.mesh_axes(((0,), (1,)), mesh) == ()
  # Positions, not Device.id: on a mesh over permuted devices the same groups span the same
  # axes (mapping ids to devices would have put 0,1,2,3 on both axes here).
  permuted = Mesh(np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4),
                  ("data", "model"))
  assert hlo_groups.mesh_axes(((0, 1, 2, 3), (4, 5, 6, 7)), permuted) == ("model",)
  with pytest.raises(ValueError, match="outside"):
    hlo_groups.mesh_axes(((0, 8),), mesh)


# ---- what the TPU compiler does to collectives, as text --------------------------------

# Modelled on the v5e fsdp train step: the compiler fuses each reduce-scatter as all-reduce
# + dynamic-slice in an `all-reduce-scatter` computation and reuses channel ids across them
# (here one in the layer loop and one after it, both channel 1), and splits an async
# all-gather into start / continuation / done fusions that each hold a copy of the op.
TPU_LIKE = """\
HloModule jit_step, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%all-reduce-scatter.1 (p0: f32[64,32]) -> f32[8,32] {
  %p0 = f32[64,32]{1,0:T(8,128)S(1)} parameter(0)
  %ar.1 = f32[64,32]{1,0:T(8,128)} all-reduce(%p0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %pid = u32[] partition-id()
  %zero = u32[] constant(0)
  ROOT %ds = f32[8,32]{1,0:T(8,128)S(1)} dynamic-slice(%ar.1, %pid, %zero), dynamic_slice_sizes={8,32}
}

%all-reduce-scatter.2 (p0: f32[16,32]) -> f32[2,32] {
  %p0.2 = f32[16,32]{1,0:T(8,128)S(1)} parameter(0)
  %ar.2 = f32[16,32]{1,0:T(8,128)} all-reduce(%p0.2), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %pid.2 = u32[] partition-id()
  %zero.2 = u32[] constant(0)
  ROOT %ds.2 = f32[2,32]{1,0:T(8,128)S(1)} dynamic-slice(%ar.2, %pid.2, %zero.2), dynamic_slice_sizes={2,32}
}

%fused_computation.5 (q: bf16[4,32]) -> (bf16[4,32], bf16[32,32]) {
  %q = bf16[4,32]{1,0} parameter(0)
  %ag.1 = bf16[32,32]{1,0:T(8,128)(2,1)} all-gather(%q), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = (bf16[4,32]{1,0}, bf16[32,32]{1,0}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.6 (r: bf16[4,32]) -> bf16[32,32] {
  %r = bf16[4,32]{1,0} parameter(0)
  ROOT %ag.2 = bf16[32,32]{1,0:T(8,128)(2,1)S(1)} all-gather(%r), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, use_global_device_ids=true
}

%fused_computation.7 (t: bf16[4,32]) -> bf16[32,32] {
  %t = bf16[4,32]{1,0} parameter(0)
  %ag.3 = bf16[32,32]{1,0:T(8,128)(2,1)} all-gather(%t), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  ROOT %cd = bf16[32,32]{1,0} custom-call(%ag.3), custom_call_target="AsyncCollectiveDone"
}

%body (p: (s32[], f32[64,32], bf16[4,32])) -> (s32[], f32[64,32], bf16[4,32]) {
  %p = (s32[], f32[64,32]{1,0}, bf16[4,32]{1,0}) parameter(0)
  %g = f32[64,32]{1,0} get-tuple-element(%p), index=1
  %w = bf16[4,32]{1,0} get-tuple-element(%p), index=2
  %start = (bf16[4,32]{1,0}, bf16[32,32]{1,0}) fusion(%w), kind=kCustom, calls=%fused_computation.5
  %cont = bf16[32,32]{1,0} fusion(%w), kind=kOutput, calls=%async_collective_fusion.6, backend_config={"continuation_config":{}}
  %done = bf16[32,32]{1,0} fusion(%w), kind=kCustom, calls=%fused_computation.7
  %rs = f32[8,32]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %t = (s32[], f32[64,32]{1,0}, bf16[4,32]{1,0}) tuple(%p, %g, %w)
}

%cond (c: (s32[], f32[64,32], bf16[4,32])) -> pred[] {
  %c = (s32[], f32[64,32]{1,0}, bf16[4,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: (s32[], f32[64,32], bf16[4,32]), e: f32[16,32]) -> f32[2,32] {
  %a = (s32[], f32[64,32]{1,0}, bf16[4,32]{1,0}) parameter(0)
  %e = f32[16,32]{1,0} parameter(1)
  %loop = (s32[], f32[64,32]{1,0}, bf16[4,32]{1,0}) while(%a), condition=%cond, body=%body
  ROOT %rs.2 = f32[2,32]{1,0} fusion(%e), kind=kCustom, calls=%all-reduce-scatter.2
}
"""


def test_tpu_fused_reduce_scatters_and_split_async_copies():
  ops = {c.name: c for c in hlo.collective_ops(TPU_LIKE)}
  # The three copies of the async all-gather are one op; the two reduce-scatters that share
  # channel 1 are two.
  assert sorted(ops) == ["ag.1", "ar.1", "ar.2"]
  rs1, rs2, ag = ops["ar.1"], ops["ar.2"], ops["ag.1"]
  assert (rs1.op, rs1.shapes, rs1.operand_shapes, rs1.executions, rs1.bytes) == (
      "reduce-scatter", ((8, 32),), ((64, 32),), 3, 64 * 32 * F32)
  assert (rs2.op, rs2.shapes, rs2.operand_shapes, rs2.executions, rs2.bytes) == (
      "reduce-scatter", ((2, 32),), ((16, 32),), 1, 16 * 32 * F32)
  assert (ag.op, ag.dtypes, ag.shapes, ag.executions, ag.bytes, ag.groups) == (
      "all-gather", ("bf16",), ((32, 32),), 3, 32 * 32 * 2, ALL8)
  stats = hlo.collectives(TPU_LIKE)
  assert stats["reduce-scatter"] == hlo.Collective(
      count=4, bytes=3 * 64 * 32 * F32 + 16 * 32 * F32, ops=2)
  assert stats["all-gather"] == hlo.Collective(count=3, bytes=3 * 32 * 32 * 2, ops=1)
  assert stats["all-reduce"] == hlo.Collective(0, 0, 0)


# ---- compiled programs -----------------------------------------------------------------

def _tpu_devices():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install 'jax[tpu]'; compiling needs no TPU)")
  from shardlab.plan.compiled import aot
  return aot.tpu_devices("v5e", 8)[0]


def devices(backend: str):
  return list(jax.devices()) if backend == "cpu" else list(_tpu_devices())


BACKENDS = pytest.mark.parametrize("backend", ["cpu", "tpu"])


def matmul_sum(mesh: Mesh) -> str:
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
  f = jax.jit(lambda x, w: (x @ w).sum(), out_shardings=NamedSharding(mesh, P()))
  return f.lower(x, w).compile().as_text()


@BACKENDS
def test_sharded_matmul_and_sum(backend):
  """x[16,32] split data × model, w[32,64] split model-wise over rows: each device multiplies
  its [8,8] block by its [8,64] rows, so the [8,64] partial products are summed over
  `model`; the sum of everything then adds the per-data-row scalars over `data`."""
  mesh = Mesh(np.array(devices(backend)).reshape(2, 4), ("data", "model"))
  text = matmul_sum(mesh)
  ops = hlo.collective_ops(text)
  assert [(c.op, c.dtypes, c.shapes, c.executions, c.bytes) for c in ops] == [
      ("all-reduce", ("f32",), ((8, 64),), 1, 8 * 64 * F32),
      ("all-reduce", ("f32",), ((),), 1, F32)]
  assert [c.groups for c in ops] == [((0, 1, 2, 3), (4, 5, 6, 7)),
                                     ((0, 4), (1, 5), (2, 6), (3, 7))]
  axes = lambda c: ",".join(hlo_groups.mesh_axes(c.groups, mesh))
  assert hlo.collectives(text, label=axes) == {
      ("all-reduce", "model"): hlo.Collective(count=1, bytes=8 * 64 * F32, ops=1),
      ("all-reduce", "data"): hlo.Collective(count=1, bytes=F32, ops=1)}
  assert hlo.collectives(text)["all-reduce"] == hlo.Collective(2, 8 * 64 * F32 + F32, 2)


def test_groups_name_mesh_positions_not_device_ids():
  """A mesh over permuted devices compiles to the same groups, which span the same axes."""
  devs = np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]]
  mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
  ops = hlo.collective_ops(matmul_sum(mesh))
  assert [hlo_groups.mesh_axes(c.groups, mesh) for c in ops] == [("model",), ("data",)]
  assert ops[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_gathered_members_come_in_group_order():
  """Run it: every device contributes its position in the mesh (on permuted devices), and
  the all-gather over (z, x) returns them in the order of the parsed group it belongs to."""
  devs = np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]]
  mesh = Mesh(devs.reshape(2, 2, 2), ("x", "y", "z"))
  spec = P(("x", "y", "z"))
  f = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, ("z", "x"), tiled=True),
                            mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  positions = jnp.arange(8.0)
  (op,) = hlo.collective_ops(f.lower(positions).compile().as_text())
  gathered = np.asarray(f(positions)).reshape(8, 4).astype(int)
  group_of = {i: g for g in op.groups for i in g}
  assert [tuple(row) for row in gathered] == [group_of[i] for i in range(8)]
  assert hlo_groups.mesh_axes(op.groups, mesh) == ("x", "z")


@pytest.mark.parametrize("spec", [("x", "z"), ("z", "x"), ("y",), ("z", "y", "x")])
def test_mesh_form_groups_from_resharding(spec):
  """Gathering an array split over `spec` on a 2×2×2 mesh: XLA prints mesh-axes groups
  with a transposed device grid; each group holds the devices that share the other axes'
  coordinates, ordered as the array's shards are (spec's first axis major)."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("x", "y", "z"))
  f = jax.jit(lambda v: v * 2, in_shardings=NamedSharding(mesh, P(spec)),
              out_shardings=NamedSharding(mesh, P()))
  (op,) = hlo.collective_ops(f.lower(jnp.zeros((8, 16), jnp.float32)).compile().as_text())
  grid = np.arange(8).reshape(2, 2, 2)
  moved = np.moveaxis(grid, [mesh.axis_names.index(a) for a in spec],
                      list(range(3 - len(spec), 3)))
  want = tuple(map(tuple, moved.reshape(-1, 2 ** len(spec)).tolist()))
  assert (op.op, op.shapes, op.operand_shapes) == (
      "all-gather", ((8, 16),), ((8 // 2 ** len(spec), 16),))
  assert op.groups == want
  assert set(hlo_groups.mesh_axes(op.groups, mesh)) == set(spec)
  assert op.bytes == 8 * 16 * F32


def shard_map_loop(mesh: Mesh) -> str:
  """Five scan steps of: ppermute and all-gather, psum_scatter over `model`, all_to_all over
  `data`, on each device's [8,8] f32 block of a [16,32] array."""
  spec = P("data", "model")

  def body(c, _):
    c = jax.lax.ppermute(c, "model", [(i, (i + 1) % 4) for i in range(4)])
    g = jax.lax.all_gather(c, "model", axis=1, tiled=True)  # [8,32]
    s = jax.lax.psum_scatter(g, "model", scatter_dimension=1, tiled=True)  # [8,8]
    return jax.lax.all_to_all(s, "data", 0, 0, tiled=True) + c, None

  f = jax.shard_map(lambda x: jax.lax.scan(body, x, None, length=5)[0], mesh=mesh,
                    in_specs=spec, out_specs=spec)
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, spec))
  return jax.jit(f).lower(x).compile().as_text()


@BACKENDS
def test_collectives_in_a_loop(backend):
  mesh = Mesh(np.array(devices(backend)).reshape(2, 4), ("data", "model"))
  text = shard_map_loop(mesh)
  ops = {c.op: c for c in hlo.collective_ops(text)}
  block = 8 * 8 * F32
  axes = {op: hlo_groups.mesh_axes(c.groups, mesh) for op, c in ops.items()}
  # The TPU compiler runs the permute async (start/done: (operand, result, u32, u32) then
  # the result) and lowers psum_scatter as all-reduce + slice; XLA:CPU keeps both whole.
  scatter = "reduce-scatter" if backend == "cpu" else "all-reduce"
  assert set(ops) == {"collective-permute", "all-gather", scatter, "all-to-all"}
  assert all(c.executions == 5 for c in ops.values())
  permute = ops["collective-permute"]
  assert (permute.dtypes, permute.shapes, permute.bytes) == (("f32",), ((8, 8),), block)
  assert permute.groups == ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4))
  assert (ops["all-gather"].shapes, ops["all-gather"].bytes) == (((8, 32),), 4 * block)
  assert ops[scatter].bytes == 4 * block  # the full [8,32] side either way
  assert ops["all-to-all"].bytes == block
  assert axes == {"collective-permute": ("model",), "all-gather": ("model",),
                  scatter: ("model",), "all-to-all": ("data",)}
  stats = hlo.collectives(text)
  assert stats["all-gather"] == hlo.Collective(count=5, bytes=5 * 4 * block, ops=1)
  assert stats["collective-permute"] == hlo.Collective(count=5, bytes=5 * block, ops=1)


@BACKENDS
def test_collectives_sharing_a_channel_id_are_counted_apart(backend):
  """shard_map numbers all its collectives channel 1: two gathers of equal shape are two."""
  mesh = Mesh(np.array(devices(backend)).reshape(2, 4), ("data", "model"))
  spec = P("data", "model")
  f = jax.shard_map(lambda x, y: jax.lax.all_gather(jnp.sin(x), "model", axis=1, tiled=True) *
                    jax.lax.all_gather(jnp.cos(y), "model", axis=1, tiled=True),
                    mesh=mesh, in_specs=(spec, spec), out_specs=P("data"), check_vma=False)
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, spec))
  text = jax.jit(f).lower(x, x).compile().as_text()
  gathers = [c for c in hlo.collective_ops(text) if c.op == "all-gather"]
  assert len(gathers) == 2 and gathers[0].channel_id == gathers[1].channel_id
  assert hlo.collectives(text)["all-gather"] == hlo.Collective(
      count=2, bytes=2 * 8 * 32 * F32, ops=2)


def test_an_instruction_spanning_lines_does_not_end_its_computation():
  """The splash kernel's custom call prints `frontend_attributes={kernel_metadata={` and
  closes it on a line that starts with "}}": the parser read that as the computation's end
  and dropped everything after the kernel (the step FLOPs plan/auto ranks by came out a
  seventh of the truth for flash programs). Here a matmul after the kernel, compiled for v5e:
  every instruction line is read, and the dot FLOPs are the matmul's exactly."""
  from shardlab.observe import hlo_flops, hlo_text
  from shardlab.parallel import flash
  from shardlab.runtime import compile_only
  from shardlab.sharding import rules as rules_lib
  from shardlab.sharding.activations import activation_rules
  mesh = Mesh(np.array(_tpu_devices()).reshape(4, 2), ("data", "tensor"))
  shard = NamedSharding(mesh, P("data", None, "tensor"))
  q = jax.ShapeDtypeStruct((8, 512, 4, 128), jnp.bfloat16, sharding=shard)
  k = jax.ShapeDtypeStruct((8, 512, 2, 128), jnp.bfloat16, sharding=shard)
  w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def f(q, k, v, w):  # forward only: one dot, after the kernel, in the same computation
    out = flash.causal(q, k, v, platform="tpu")
    return jnp.einsum("blhd,df->blhf", out, w, preferred_element_type=jnp.float32).sum()

  with activation_rules(mesh, rules_lib.strategy("tp")):
    text = compile_only.compile_lowered(jax.jit(f).lower(q, k, k, w), "tpu").as_text()
  assert "kernel_metadata={\n" in text  # the case: an attribute that spans lines
  computations, _ = hlo.parse(text)
  lines = [l for l in text.splitlines() if hlo_text._INSTRUCTION.match(l)]
  assert sum(len(c) for c in computations.values()) == len(lines)
  per_device = 8 // 4 * 512 * 4 // 2  # rows of (b, l, h) on one device
  assert hlo_flops.dot_flops(text) == 2 * per_device * 128 * 256


def test_estimated_cycles_count_a_loop_body_once_per_trip():
  """XLA:TPU's per-instruction estimates summed over a step: a scan of n identical matmul
  layers costs a + n·b, so going from 4 to 8 layers adds twice what going from 2 to 4 did
  (compiled.cost_analysis() counts the body once, whatever n). XLA:CPU writes no estimate."""
  from shardlab.observe import hlo_cycles
  from shardlab.runtime import compile_only
  mesh = Mesh(np.array(_tpu_devices()).reshape(8), ("data",))

  def program(n: int, on) -> str:
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(on, P("data")))
    w = jax.ShapeDtypeStruct((n, 512, 512), jnp.bfloat16, sharding=NamedSharding(on, P()))
    layer = lambda x, w: (jnp.tanh(x @ w), None)
    lowered = jax.jit(lambda x, ws: jax.lax.scan(layer, x, ws)[0].sum()).lower(x, w)
    return compile_only.compile_lowered(lowered, on.devices.flat[0].platform).as_text()

  c2, c4, c8 = (hlo_cycles.estimated_cycles(program(n, mesh)) for n in (2, 4, 8))
  assert 0 < c2 < c4 < c8
  assert c8 - c4 == 2 * (c4 - c2), (c2, c4, c8)
  cpu = Mesh(np.array(jax.devices()[:8]).reshape(8), ("data",))
  assert hlo_cycles.estimated_cycles(program(4, cpu)) == 0
