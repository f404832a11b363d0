"""Every leaf of the train state lives exactly where its strategy's rules put it, and each
device holds the share of the state's bytes that the strategy promises."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import helpers as H
from shardlab.sharding import rules as rules_lib
from shardlab.testing import bytes_per_device

# optax.adafactor factors a leaf's second moment when its two largest dims are >= this.
MIN_DIM_TO_FACTOR = 128


def flat(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def assert_placed(leaf, mesh, expected: P, what: str):
  sharding = leaf.sharding
  assert isinstance(sharding, NamedSharding), f"{what}: {sharding!r} is not a NamedSharding"
  assert sharding.mesh == mesh, f"{what}: placed on another mesh"
  got, want = H.normalized(sharding.spec, leaf.ndim), H.normalized(expected, leaf.ndim)
  assert got == want, f"{what} {leaf.shape}: spec {got}, rules say {want}"


def rule_spec(names, shape, table, mesh) -> P:
  return rules_lib.spec(tuple(names), tuple(shape), table, mesh, "test")


def param_of(keypath, names: dict):
  """The param path an optimizer leaf belongs to (optax nests copies of the param tree)."""
  path = H.dict_path(keypath)
  return path if path in names else None


def adafactor_names(field: str, param_shape, param_names):
  """Logical names optax.adafactor's leaf `field` has for a param: its factoring rule is
  the two largest dims (argsort order, so ties go to the later dim as the largest);
  v_row drops the largest dim, v_col the second largest; an unused slot is shape (1,)."""
  shape = tuple(param_shape)
  factored = None
  if len(shape) >= 2:
    order = np.argsort(shape)
    if shape[order[-2]] >= MIN_DIM_TO_FACTOR:
      factored = (int(order[-2]), int(order[-1]))  # (second largest, largest)
  drop = lambda dim: tuple(n for i, n in enumerate(param_names) if i != dim)
  if field == "v":
    return (None,) if factored else tuple(param_names)
  if not factored:
    return (None,)
  second, largest = factored
  return drop(largest) if field == "v_row" else drop(second)


def expected_opt_specs(r: H.Run, optimizer: str):
  """{keystr: spec} for every optimizer-state leaf, from the rules and the param names."""
  names = H.param_names(r.abstract)
  shapes = {H.dict_path(p): a.shape for p, a in flat(r.abstract.state.params)}
  out = {}
  for keypath, leaf in flat(r.abstract.state.opt_state):
    param = param_of(keypath, names)
    fields = H.attr_names(keypath)
    if param is None:
      assert leaf.shape == (), f"{jax.tree_util.keystr(keypath)}: optimizer leaf with no param"
      out[jax.tree_util.keystr(keypath)] = P()
      continue
    if optimizer == "adamw":
      assert fields[-1] in ("mu", "nu"), jax.tree_util.keystr(keypath)
      assert leaf.shape == shapes[param]
      leaf_names = names[param]
    else:
      field = fields[-1]
      assert field in ("v_row", "v_col", "v"), jax.tree_util.keystr(keypath)
      leaf_names = adafactor_names(field, shapes[param], names[param])
    out[jax.tree_util.keystr(keypath)] = rule_spec(leaf_names, leaf.shape, r.rules.opt_state, r.mesh)
  return out


def check_state_placement(r: H.Run, state, optimizer: str):
  names = H.param_names(r.abstract)
  assert_placed(state.step, r.mesh, P(), "step")
  for keypath, leaf in flat(state.params):
    spec = rule_spec(names[H.dict_path(keypath)], leaf.shape, r.rules.params, r.mesh)
    assert_placed(leaf, r.mesh, spec, f"param {jax.tree_util.keystr(keypath)}")
  expected = expected_opt_specs(r, optimizer)
  assert len(expected) == len(jax.tree.leaves(state.opt_state))
  for keypath, leaf in flat(state.opt_state):
    assert_placed(leaf, r.mesh, expected[jax.tree_util.keystr(keypath)], f"opt {jax.tree_util.keystr(keypath)}")


# ---- the rules themselves, against specs written out by hand ---------------------------

Q = ("blocks", "attn", "q_DxHxE")  # layers, embed, heads, head_dim
O = ("blocks", "attn", "o_HxExD")  # layers, heads, head_dim, embed
DOWN = ("blocks", "mlp", "down_FxD")  # layers, mlp, embed
NORM = ("blocks", "attn_norm", "scale")  # layers, embed
EMBED = ("embed_VxD",)  # vocab, embed
HEAD = ("head_DxV",)  # embed, vocab
FINAL = ("final_norm", "scale")  # embed

_ = None
HAND_WRITTEN = {
    # strategy: {param: (param spec, optimizer-state spec)}, and the batch spec
    "dp": ({Q: ((_, _, _, _), (_, _, _, _)), EMBED: ((_, _), (_, _)), FINAL: ((_,), (_,))},
           ("data", _)),
    # ZeRO-1/2: the stored (master) weights are sharded like the optimizer state.
    "zero1": ({Q: ((_, "data", _, _),) * 2, O: ((_, _, _, "data"),) * 2,
               EMBED: ((_, "data"),) * 2, HEAD: (("data", _),) * 2,
               FINAL: (("data",),) * 2}, ("data", _)),
    "zero2": ({Q: ((_, "data", _, _),) * 2, EMBED: ((_, "data"),) * 2}, ("data", _)),
    "fsdp": ({Q: ((_, "fsdp", _, _),) * 2, O: ((_, _, _, "fsdp"),) * 2,
              DOWN: ((_, _, "fsdp"),) * 2, NORM: ((_, "fsdp"),) * 2,
              EMBED: ((_, "fsdp"),) * 2, HEAD: (("fsdp", _),) * 2, FINAL: (("fsdp",),) * 2},
             ("fsdp", _)),
    "tp": ({Q: ((_, _, "tensor", _),) * 2, O: ((_, "tensor", _, _),) * 2,
            DOWN: ((_, "tensor", _),) * 2, NORM: ((_, _),) * 2,
            EMBED: (("tensor", _),) * 2, HEAD: ((_, "tensor"),) * 2},
           ("data", _)),
    "fsdp_tp": ({Q: ((_, "fsdp", "tensor", _),) * 2, O: ((_, "tensor", _, "fsdp"),) * 2,
                 DOWN: ((_, "tensor", "fsdp"),) * 2, NORM: ((_, "fsdp"),) * 2,
                 EMBED: (("tensor", "fsdp"),) * 2, HEAD: (("fsdp", "tensor"),) * 2},
                ("fsdp", _)),
}
# Sequence parallelism splits activations, not weights: tp's and fsdp_tp's placements.
HAND_WRITTEN |= {"tp_sp": HAND_WRITTEN["tp"], "fsdp_tp_sp": HAND_WRITTEN["fsdp_tp"]}


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_shardings_match_hand_written_specs(strategy):
  r = H.run(strategy)
  table, batch = HAND_WRITTEN[strategy]
  params = {H.dict_path(p): s for p, s in flat(r.sh.state.params)}
  grads = {H.dict_path(p): s for p, s in flat(r.sh.grads)}
  mu = {H.dict_path(p): s for p, s in flat(r.sh.state.opt_state)
        if H.attr_names(p)[-1:] == ("mu",)}
  for path, (param_spec, opt_spec) in table.items():
    ndim = len(param_spec)
    assert H.normalized(params[path].spec, ndim) == param_spec, (path, params[path])
    assert H.normalized(mu[path].spec, ndim) == opt_spec, (path, mu[path])
    # Gradients: reduce-scattered to the optimizer's shards (zero2), all-reduced whole
    # (zero1, beside its whole working copy), else where the weights are stored.
    grad_spec = {"zero2": opt_spec, "zero1": (None,) * ndim}.get(strategy, param_spec)
    assert H.normalized(grads[path].spec, ndim) == grad_spec, (path, grads[path])
  assert H.normalized(r.sh.batch.spec, 2) == batch


# ---- the placed arrays -----------------------------------------------------------------

@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_adamw_state_leaves_have_rule_shardings(strategy):
  r = H.run(strategy)
  check_state_placement(r, r.init, "adamw")
  # The train step hands the state back with the same shardings.
  state, _ = r.train(r.fresh_state(), 1)
  check_state_placement(r, state, "adamw")


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_adafactor_state_shardings_follow_factoring(strategy):
  """Specs only (no compile): factored rows/cols drop the reduced dim's rule."""
  r = H.run(strategy, optimizer="adafactor")
  expected = expected_opt_specs(r, "adafactor")
  fields = set()
  for (keypath, sharding), leaf in zip(flat(r.sh.state.opt_state),
                                       jax.tree.leaves(r.abstract.state.opt_state)):
    ndim = len(leaf.shape)
    assert H.normalized(sharding.spec, ndim) == H.normalized(expected[jax.tree_util.keystr(keypath)],
                                                             ndim), jax.tree_util.keystr(keypath)
    fields.add((H.attr_names(keypath)[-1:], leaf.shape == (1,)))
  # The micro model has both factored and unfactored params, so all cases were seen.
  assert {(("v_row",), False), (("v_col",), False), (("v",), False), (("v",), True),
          (("v_row",), True)} <= fields


@pytest.mark.parametrize("strategy", ["fsdp_tp", "zero1"])
def test_adafactor_init_leaves_have_rule_shardings(strategy):
  r = H.run(strategy, optimizer="adafactor")
  check_state_placement(r, r.init, "adafactor")


def test_adafactor_square_factored_leaf_keeps_its_own_dim():
  """Equal factored dims (vocab == d_model): v_row and v_col must still differ."""
  model = dataclasses.replace(H.MICRO, vocab_size=H.MICRO.d_model)  # embed_VxD is square
  r = H.run("fsdp_tp", model=model, optimizer="adafactor")
  expected = expected_opt_specs(r, "adafactor")
  wrong = []
  for keypath, sharding in flat(r.sh.state.opt_state):
    want = expected[jax.tree_util.keystr(keypath)]
    if H.normalized(sharding.spec, len(want)) != H.normalized(want, len(want)):
      wrong.append(f"{jax.tree_util.keystr(keypath)}: {sharding.spec} (rules say {want})")
  assert not wrong, "\n".join(wrong)


# ---- bytes per device ------------------------------------------------------------------

def split_bytes(tree) -> tuple[int, int]:
  """(bytes of scalar leaves, bytes of the rest), each counted once."""
  scalars = sum(x.nbytes for x in jax.tree.leaves(tree) if x.ndim == 0)
  return scalars, sum(x.nbytes for x in jax.tree.leaves(tree)) - scalars


def only_value(per_device: dict) -> int:
  assert len(per_device) == 8
  values = set(per_device.values())
  assert len(values) == 1, f"devices hold different amounts: {per_device}"
  return values.pop()


def test_fsdp_device_holds_an_eighth_of_the_state():
  state = H.run("fsdp").init
  scalars, rest = split_bytes(state)
  assert scalars <= 16  # step and the optimizer's step counts
  assert rest % 8 == 0
  assert only_value(bytes_per_device(state)) == rest // 8 + scalars


def test_dp_device_holds_the_whole_state():
  state = H.run("dp").init
  scalars, rest = split_bytes(state)
  assert only_value(bytes_per_device(state)) == rest + scalars


# Bytes per parameter a device stores between steps (the micro model's every param has an
# `embed` dim that splits 8 ways): stored weights + Adam's two moments, in each policy.
STORED = {"fp32": 4 + 8, "bf16": 4 + 8, "bf16-params": 2 + 4}


@pytest.mark.parametrize("precision", sorted(STORED))
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "fsdp"])
def test_zero_stages_store_what_the_paper_says(strategy, precision):
  """dp keeps the whole state on every device; ZeRO-1 and -2 (and 3, fsdp) keep 1/8 of the
  stored weights (the fp32 master under bf16) and of the optimizer state."""
  state = H.run(strategy, precision=precision).init
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  scalars = split_bytes(state)[0]
  ways = 1 if strategy == "dp" else 8
  assert only_value(bytes_per_device(state)) == n_params * STORED[precision] // ways + scalars


@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_device_bytes_follow_the_specs(strategy):
  """Each device holds sum(leaf bytes / ways its spec splits it), for every strategy."""
  r = H.run(strategy)
  state = r.init
  want = 0
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(r.sh.state)):
    ways = H.shard_factor(sharding.spec, r.mesh)
    assert leaf.nbytes % ways == 0
    want += leaf.nbytes // ways
  assert only_value(bytes_per_device(state)) == want
  if strategy == "tp":  # norms stay whole, the matmul weights are split 4 ways
    assert split_bytes(state)[1] // 4 < want < split_bytes(state)[1] // 2
