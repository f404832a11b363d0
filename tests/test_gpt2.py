"""The second bundled architecture (GPT-2 family): exact parameter counts, parity with one
device under every strategy, and the tools (inspect, plan --compile, generate) on it."""

import functools

import jax
import numpy as np
import pytest

import helpers as H
from shardlab import generate
from shardlab.models import registry
from shardlab.models.gpt2_config import GPT2Config
from shardlab.plan.training import layout as inspect_state
from shardlab.training import run as run_lib

# The released checkpoints' parameter counts (GPT2LMHeadModel, tied head).
RELEASED = {"gpt2-124m": 124_439_808, "gpt2-355m": 354_823_168, "gpt2-774m": 774_030_080,
            "gpt2-1.5b": 1_557_611_200}
# 4 heads and mlp 256 divide a 4-way tensor axis; d_model 64 divides the 8-way fsdp axis.
MICRO = GPT2Config(name="gpt2-micro", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                   max_seq_len=64)
STEPS = 3


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_preset_parameter_counts_equal_the_released_checkpoints(preset):
  model = registry.load(preset)
  assert model.n_params == RELEASED[preset]
  abstract = run_lib.abstract_state(H.make_config(model=model))
  counted = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract.state.params))
  assert counted == RELEASED[preset]


@functools.cache
def reference():
  r = H.run("dp", "data:1", model=MICRO)
  final, history = r.train(r.fresh_state(), STEPS)
  return jax.tree.map(np.asarray, r.init), jax.tree.map(np.asarray, final), history


@pytest.mark.slow
@pytest.mark.parametrize("strategy", H.STRATEGIES)
def test_every_strategy_matches_one_device(strategy):
  init, want, want_history = reference()
  r = H.run(strategy, model=MICRO)
  H.assert_trees_equal(jax.tree.map(np.asarray, r.init.params), init.params, "init ")
  final, history = r.train(r.fresh_state(), STEPS)
  for got, expected in zip(history, want_history):
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
  # 3e-5 of each leaf's largest entry: a position-table entry whose gradient is rounding
  # noise moves by Adam's full step, whichever the reduction order (seen: 1.4e-5 under
  # fsdp_tp, whose lookup reads the table where it is stored).
  H.assert_trees_close(without_key_bias(final.params), without_key_bias(want.params),
                       rtol=1e-5, scaled_atol=3e-5, what=f"{strategy} params ")


def without_key_bias(params):
  """The params on the host, less the key bias: its true gradient is exactly zero (adding
  q·b to every score of a row leaves the softmax unchanged), so what it gets is rounding
  noise that Adam scales up to full-size steps, different under every reduction order."""
  params = jax.tree.map(np.asarray, params)
  del params["blocks"]["attn"]["k_bias_HxE"]
  return params


# Where fsdp_tp (fsdp:4, tensor:2) puts each kind of GPT-2 param, written out by hand.
FSDP_TP = {
    "wte_VxD": ("tensor", "fsdp"), "wpe_PxD": (None, "fsdp"),
    "q_DxHxE": (None, "fsdp", "tensor", None), "q_bias_HxE": (None, "tensor", None),
    "o_HxExD": (None, "tensor", None, "fsdp"), "o_bias_D": (None, "fsdp"),
    "fc_DxF": (None, "fsdp", "tensor"), "fc_bias_F": (None, "tensor"),
    "proj_FxD": (None, "tensor", "fsdp"), "scale": (None, "fsdp"), "bias": (None, "fsdp"),
}


def test_fsdp_tp_places_every_gpt2_param():
  r = H.run("fsdp_tp", model=MICRO)
  seen = set()
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(r.init.params)[0]:
    path = H.dict_path(keypath)
    key = path[-1] if path[-1] in FSDP_TP else path[-1].replace("k_", "q_").replace("v_", "q_")
    if path == ("final_norm", "scale") or path == ("final_norm", "bias"):
      want = ("fsdp",)
    elif key == "proj_bias_D":
      want = (None, "fsdp")
    else:
      want = FSDP_TP[key]
    assert H.normalized(leaf.sharding.spec, leaf.ndim) == want, path
    seen.add(path)
  assert len(seen) == len(jax.tree.leaves(r.init.params)) == 20


def test_inspect_lists_every_gpt2_param():
  cfg = H.make_config("fsdp_tp", "fsdp:4,tensor:2", model=MICRO)
  r = H.run("fsdp_tp", model=MICRO)
  layout = inspect_state.layout(cfg, r.abstract, r.sh)
  assert sum(row.size for row in layout.params) == MICRO.n_params
  wte = next(row for row in layout.params if row.path.endswith("wte_VxD"))
  assert wte.local_shape == (256 // 2, 64 // 4)  # vocab over tensor, embed over fsdp
  assert {row.path for row in layout.activations} >= {"residual", "logits", "kv_cache"}


def test_cached_generation_equals_uncached():
  r = H.run("fsdp_tp", model=MICRO)
  gen = generate.Generator(r.cfg, r.abstract, r.sh)
  sampling = generate.Sampling(max_new_tokens=6, temperature=0.0, top_k=0)
  prompt = np.array([3, 1, 4, 1, 5], np.int32)
  cached = gen.tokens(r.init.params, prompt, sampling)
  uncached = gen.tokens(r.init.params, prompt, sampling, use_cache=False)
  np.testing.assert_array_equal(cached, uncached)


def test_checkpoint_round_trip_onto_another_strategy(tmp_path):
  from shardlab.training import checkpoint
  source, target = H.run("fsdp_tp", model=MICRO), H.run("tp", model=MICRO)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(source.init, force=True)
  ckpt.wait()
  restored, progress = ckpt.restore(target.abstract, target.sh)
  ckpt.close()
  assert progress == {"step": 0}
  H.assert_trees_equal(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, source.init))
  leaf = restored.params["blocks"]["mlp"]["fc_DxF"]
  assert H.normalized(leaf.sharding.spec, 3) == (None, None, "tensor")
