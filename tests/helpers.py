"""Shared pieces for the sharding tests: a micro model, runs built per strategy and mesh
(cached for the whole session, since compiling dominates the time on CPU), token batches,
tree comparison. Collectives in compiled HLO are read by the product's parser,
shardlab.observe.hlo.
"""

import dataclasses
import functools
import importlib.util
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardlab import config
from shardlab.sharding import mesh as mesh_lib
from shardlab.sharding import rules as rules_lib
from shardlab.training import state as state_lib
from shardlab.training import step
from shardlab.models.llama_config import LlamaConfig
from shardlab.training import run as run_lib
from shardlab.sharding.activations import activation_rules

# d_model and mlp are >= 128 so Adafactor factors its second moments (optax factors a
# leaf only when two dims are >= 128); vocab differs from d_model so no factored matrix
# is square. 8 query and 4 kv heads divide a 4-way tensor axis.
MICRO = LlamaConfig(name="micro", vocab_size=256, d_model=128, n_layers=2, n_heads=8,
                           n_kv_heads=4, head_dim=16, mlp_dim=256, max_seq_len=64)
TRAIN = config.TrainConfig(steps=10, global_batch=32, seq_len=16, microbatches=1,
                           optimizer="adamw", lr=1e-2, warmup_steps=1, precision="fp32",
                           seed=0)

# The mesh each strategy is meant for, on the 8 simulated devices.
MESHES = {
    "dp": "data:-1",
    "zero1": "data:-1",
    "zero2": "data:-1",
    "fsdp": "fsdp:-1",
    "tp": "data:2,tensor:4",
    "fsdp_tp": "fsdp:4,tensor:2",
    # Sequence parallelism: tp's and fsdp_tp's weights, the residual stream split over tensor
    # along the sequence (16 tokens: 4 a device on tensor:4).
    "tp_sp": "data:2,tensor:4",
    "fsdp_tp_sp": "fsdp:4,tensor:2",
}
STRATEGIES = tuple(MESHES)
REFERENCE = ("dp", "data:1")  # one device: every spec resolves to replicated


def make_config(strategy: str = REFERENCE[0], mesh: str = REFERENCE[1], model=MICRO,
                **train) -> config.Config:
  return config.Config(model=model, mesh=mesh, strategy=strategy,
                       train=dataclasses.replace(TRAIN, **train))


def tokens(cfg: config.Config, seed: int = 0) -> np.ndarray:
  """A deterministic int32 batch of shape (global_batch, seq_len + 1)."""
  rng = np.random.default_rng(1000 + seed)
  shape = (cfg.train.global_batch, cfg.train.seq_len + 1)
  return rng.integers(0, cfg.model.vocab_size, size=shape, dtype=np.int32)


def copy_tree(tree):
  """Fresh buffers with the same shardings (the train step donates its state)."""
  return jax.tree.map(lambda x: x.copy(), tree)


class Run:
  """Everything one (strategy, mesh, train settings) needs; each piece built once."""

  def __init__(self, cfg: config.Config, n_devices: int | None):
    self.cfg = cfg
    devices = jax.devices()[:n_devices] if n_devices else None
    self.mesh = mesh_lib.build(mesh_lib.parse_inline(cfg.mesh), devices=devices)
    self.rules = rules_lib.strategy(cfg.strategy)
    self.abstract = run_lib.abstract_state(cfg)
    self.sh = run_lib.shardings(cfg, self.abstract, self.mesh, offload=True)
    self.replicated = NamedSharding(self.mesh, PartitionSpec())

  @functools.cached_property
  def init(self) -> state_lib.TrainState:
    """The sharded init; never donated (hand out `fresh_state()` to the step)."""
    return jax.block_until_ready(state_lib.init_state(self.abstract, self.sh))

  def fresh_state(self, like: state_lib.TrainState | None = None) -> state_lib.TrainState:
    """A copy of the init, or of `like` (any placement) moved onto this run's shardings."""
    if like is None:
      return copy_tree(self.init)
    return jax.device_put(jax.tree.map(np.asarray, like), self.sh.state)

  def batch(self, seed: int = 0) -> jax.Array:
    return jax.device_put(tokens(self.cfg, seed), self.sh.batch)

  @functools.cached_property
  def train_step(self):
    return run_lib.make_steps(self.cfg, self.abstract, self.sh)[0]

  @functools.cached_property
  def abstract_args(self) -> tuple:
    """The step's (state, batch) as shapes with their shardings."""
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         self.abstract.state, self.sh.state)
    shape = (self.cfg.train.global_batch, self.cfg.train.seq_len + 1)
    return state, jax.ShapeDtypeStruct(shape, np.int32, sharding=self.sh.batch)

  @functools.cached_property
  def lowered_step(self):
    return self.train_step.lower(*self.abstract_args)

  @functools.cached_property
  def compiled_step(self):
    return self.lowered_step.compile()

  @functools.cached_property
  def value_and_grad(self):
    """jit(params, batch) -> (loss, grads), grads left where the step reduces them to."""
    abstract = self.abstract

    loss = step.model_loss(run_lib.loss_fn(self.cfg), abstract)

    def loss_and_grads(params, batch):
      with activation_rules(self.mesh, self.rules):
        return jax.value_and_grad(lambda p: loss(p, batch)[0])(params)

    return jax.jit(loss_and_grads, in_shardings=(self.sh.state.params, self.sh.batch),
                   out_shardings=(self.replicated, self.sh.grads))

  def train(self, state, n_steps: int, first_seed: int = 0):
    """Runs `n_steps` steps on batches first_seed, first_seed + 1, ...; returns the final
    state and the metrics of every step as floats."""
    history = []
    for i in range(n_steps):
      state, metrics = self.compiled_step(state, self.batch(first_seed + i))
      history.append({k: float(v) for k, v in metrics.items()})
    return state, history


_RUNS: dict = {}


def run(strategy: str = REFERENCE[0], mesh: str | None = None, *, model=MICRO,
        **train) -> Run:
  """The cached Run for a strategy on its usual mesh (or `mesh`); 'data:1' is one device."""
  mesh = mesh or MESHES[strategy]
  cfg = make_config(strategy, mesh, model, **train)
  n_devices = 1 if mesh == "data:1" else None
  key = (strategy, mesh, model, cfg.train)
  if key not in _RUNS:
    _RUNS[key] = Run(cfg, n_devices)
  return _RUNS[key]


def reference(**train) -> Run:
  return run(*REFERENCE, **train)


# ---- comparing trees -------------------------------------------------------------------

def assert_trees_close(actual, expected, rtol: float, atol: float = 0.0,
                       scaled_atol: float = 0.0, what: str = ""):
  """Leafwise |a - e| <= atol + scaled_atol * max|e| + rtol * |e|, with a message naming
  every leaf that fails. `scaled_atol` lets elements near zero differ by a fraction of
  their leaf's scale (reduction order moves them by that much, not by their own size)."""
  a_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
  assert jax.tree.structure(actual) == e_def, f"{what}: tree structures differ"
  failures = []
  for (path, a), (_, e) in zip(a_leaves, e_leaves):
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
    tol = atol + scaled_atol * (np.abs(e).max() if e.size else 0.0)
    bad = ~np.isclose(a, e, rtol=rtol, atol=tol)
    if bad.any():
      err = np.abs(a - e)
      failures.append(f"{where}: {int(bad.sum())}/{a.size} elements off, "
                      f"max abs err {err.max():.3g}, max |expected| {np.abs(e).max():.3g}")
  assert not failures, "\n".join(failures)


def assert_trees_equal(actual, expected, what: str = ""):
  a_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
  assert jax.tree.structure(actual) == e_def, f"{what}: tree structures differ"
  for (path, a), (_, e) in zip(a_leaves, e_leaves):
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape, f"{what}{jax.tree_util.keystr(path)}"
    assert np.array_equal(a, e), (
        f"{what}{jax.tree_util.keystr(path)}: {int((a != e).sum())}/{a.size} elements differ")


# ---- logical names and specs -----------------------------------------------------------

dict_path = state_lib.path_of  # the dict keys of a tree path (optax adds tuples around them)


def attr_names(keypath) -> tuple[str, ...]:
  return tuple(k.name for k in keypath if isinstance(k, jax.tree_util.GetAttrKey))


def param_names(abstract) -> dict:
  """{param path: logical names} from the abstract state."""
  leaves = jax.tree_util.tree_flatten_with_path(
      abstract.names, is_leaf=lambda x: isinstance(x, tuple))[0]
  return {dict_path(p): names for p, names in leaves}


def normalized(spec: PartitionSpec, ndim: int) -> tuple:
  """A spec as a tuple of length ndim (trailing Nones made explicit, 1-tuples unwrapped)."""
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    if isinstance(entry, tuple) and len(entry) == 1:
      entry = entry[0]
    out.append(entry)
  return tuple(out)


def shard_factor(spec: PartitionSpec, mesh) -> int:
  """Into how many pieces a spec cuts a tensor."""
  n = 1
  for entry in spec:
    for axis in (entry,) if isinstance(entry, str) else (entry or ()):
      n *= mesh.shape[axis]
  return n


def placed_model(model, strategy: str, mesh_text: str, precision: str = "fp32"):
  """(cfg, mesh, rules, abstract, shardings) of `model` on a mesh ('data:1': one device)."""
  cfg = config.Config(model=model, mesh=mesh_text, strategy=strategy,
                      train=config.TrainConfig(precision=precision))
  devices = jax.devices()[:1] if mesh_text == "data:1" else None
  m = mesh_lib.build(mesh_lib.parse_inline(mesh_text), devices=devices)
  r = rules_lib.strategy(strategy)
  abstract = run_lib.abstract_state(cfg)
  return cfg, m, r, abstract, state_lib.shardings(abstract, r, m)


def model_logits(params, m, r, abstract, sh, tokens) -> np.ndarray:
  """The module's forward on `tokens` with these params, sharded as `sh` places them."""
  def forward(p, t):
    with activation_rules(m, r):
      return nnx.merge(abstract.graphdef, p)(t)
  return np.asarray(jax.jit(forward, in_shardings=(sh.state.params, sh.batch))(params, tokens))


@functools.cache
def mixer():
  """examples/mixer.py as a module (examples/ is no package): the user's own module the
  toolkit tests run."""
  path = Path(__file__).resolve().parents[1] / "examples" / "mixer.py"
  spec = importlib.util.spec_from_file_location("mixer", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
