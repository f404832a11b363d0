"""shardlab: declarative sharding for training any Flax NNX module in JAX.

    import shardlab as sl
    mesh = sl.mesh("data:2,fsdp:2,tensor:2")
    abstract = sl.abstract_state(lambda: MyModel(nnx.Rngs(0)), optax.adamw(1e-3))
    shardings = sl.shardings(abstract, sl.strategy("fsdp_tp"), mesh)
    state = sl.init(abstract, shardings)
    step = sl.train_step(my_loss, abstract, shardings)
    state, summary = sl.fit(lambda: MyModel(nnx.Rngs(0)), my_loss, optax.adamw(1e-3),
                            batch_fn, steps=100, mesh=mesh, strategy="fsdp_tp",
                            run_dir="runs/mine")  # the run machinery of train.py

Names resolve lazily, so `import shardlab` starts nothing and imports no JAX module until a
name is used (simulated devices can still be set up after it).
"""

import importlib

_API = {
    # devices, meshes, rules, logical names
    "simulate_devices": ("shardlab.runtime.devices", "simulate"),
    "mesh": ("shardlab.sharding.mesh", "make"),
    "strategy": ("shardlab.sharding.rules", "strategy"),
    "register_axes": ("shardlab.sharding.rules", "register_axes"),
    "param": ("shardlab.sharding.params", "param"),
    "constrain": ("shardlab.sharding.activations", "constrain"),
    # training any nnx.Module
    "abstract_state": ("shardlab.training.state", "abstract_state"),
    "shardings": ("shardlab.training.state", "shardings"),
    "init": ("shardlab.training.state", "init_state"),
    "model": ("shardlab.training.state", "model"),
    "train_step": ("shardlab.training.step", "make_train_step"),
    "eval_step": ("shardlab.training.step", "make_eval_step"),
    "Checkpointer": ("shardlab.training.checkpoint", "Checkpointer"),
    "fit": ("shardlab.training.fit", "fit"),  # the run machinery of train.py, for any module
    # the bundled models' runs, configured
    "Config": ("shardlab.config", "Config"),
    "setup": ("shardlab.training.run", "setup"),
    "auto_layout": ("shardlab.plan.auto.layout", "auto_layout"),
    "plan_module": ("shardlab.plan.module.planner", "plan_module"),
    "ConfigError": ("shardlab.errors", "ConfigError"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
  if name not in _API:
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")
  module, attr = _API[name]
  value = getattr(importlib.import_module(module), attr)
  globals()[name] = value
  return value


def __dir__():
  return __all__
