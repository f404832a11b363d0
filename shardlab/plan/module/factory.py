"""`--model path/to/file.py:NAME` or `--model package.module:NAME`: a user's own module for
`shardlab plan` and `shardlab inspect` (docs/plan-any-module.md).

What `sl.plan_module` takes, found by name:
  * NAME: the module factory. Called with no arguments, or with `rngs=nnx.Rngs(0)` when it
    has a required `rngs` parameter (so a class such as `Mixer(rngs, d=64)` is a factory
    as it stands); it must return an nnx.Module.
  * the loss, `loss_fn(model, batch)` as `sl.train_step` takes it: `--loss-fn`, a name in
    the same file (default `loss_fn`) or another `module:function`;
  * the batch, `batch_shapes(size)`: a tree of arrays or jax.ShapeDtypeStructs whose
    leading dim is `size` (the global batch): `--batch-fn`, default `batch_shapes`.
Only shapes are used: the factory runs under nnx.eval_shape, the batch is never read.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Callable

import jax
from flax import nnx

from shardlab.errors import ConfigError

DEFAULT_LOSS = "loss_fn"
DEFAULT_BATCH = "batch_shapes"
_SPEC = re.compile(r"^(?P<where>.+?\.py|[A-Za-z_][\w.]*):(?P<name>[A-Za-z_]\w*)$")


def is_factory(value: str | None) -> bool:
  """`file.py:NAME` or `package.module:NAME` (a preset name or TOML path has no colon)."""
  return bool(value) and _SPEC.match(value) is not None


@dataclasses.dataclass(frozen=True)
class UserModule:
  spec: str  # as given, e.g. "examples/mixer.py:Mixer"
  factory: Callable[[], nnx.Module]
  loss_fn: Callable | None
  batch_fn: Callable[[int], object] | None

  @property
  def name(self) -> str:
    return self.spec

  def batch(self, size: int):
    """The global batch's shapes: a tree of ShapeDtypeStructs with leading dim `size`."""
    tree = self.batch_fn(size)
    leaves = jax.tree.leaves(tree)
    if not leaves or any(getattr(x, "shape", ())[:1] != (size,) or not hasattr(x, "dtype")
                         for x in leaves):
      raise ConfigError(
          f"--batch-fn of --model {self.spec!r}: called with {size}, it must return a tree "
          f"of arrays or jax.ShapeDtypeStructs whose leading dim is {size}, got "
          f"{jax.tree.map(lambda x: getattr(x, 'shape', type(x).__name__), tree)}")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def load(spec: str, loss_fn: str | None = DEFAULT_LOSS,
         batch_fn: str | None = DEFAULT_BATCH) -> UserModule:
  """The factory named by `spec`, with its loss and batch (`loss_fn` / `batch_fn`: a name in
  the factory's file, or a `module:function` of their own; None: not needed, as for the
  parameter table)."""
  module, name = _module(spec, "--model")
  made = _callable(module, name, spec, "--model")
  named = lambda value, flag: value and _named(value, module, flag, spec)
  return UserModule(spec, _checked(made, spec), named(loss_fn, "--loss-fn"),
                    named(batch_fn, "--batch-fn"))


def _named(value: str, home, flag: str, spec: str) -> Callable:
  if is_factory(value):
    module, name = _module(value, flag)
    return _callable(module, name, value, flag)
  return _callable(home, value, value, flag, f" (the file of --model {spec!r})")


def _module(spec: str, flag: str):
  m = _SPEC.match(spec)
  if m is None:
    raise ConfigError(f"{flag} {spec!r}: expected path/to/file.py:NAME or "
                      f"package.module:NAME")
  where, name = m.group("where"), m.group("name")
  if where.endswith(".py"):
    path = Path(where).expanduser()
    if not path.is_file():
      raise ConfigError(f"{flag} {spec!r}: no file {where!r} (from {Path.cwd()})")
    key = f"shardlab_user.{path.resolve().with_suffix('').as_posix().strip('/').replace('/', '.')}"
    if key not in sys.modules:
      loader = importlib.util.spec_from_file_location(key, path)
      module = importlib.util.module_from_spec(loader)
      sys.modules[key] = module  # dataclasses and pickling look their module up here
      try:
        loader.loader.exec_module(module)
      except BaseException:
        del sys.modules[key]
        raise
    return sys.modules[key], name
  try:
    return importlib.import_module(where), name
  except ModuleNotFoundError as e:
    raise ConfigError(f"{flag} {spec!r}: cannot import {where!r} ({e}); give a module on "
                      f"sys.path or path/to/file.py:{name}") from None


def _callable(module, name: str, spec: str, flag: str, where: str = "") -> Callable:
  if not hasattr(module, name):
    defined = sorted(k for k, v in vars(module).items()
                     if callable(v) and not k.startswith("_") and
                     getattr(v, "__module__", None) == module.__name__)
    raise ConfigError(f"{flag} {spec!r}: {module.__name__}{where} has no {name!r}; it "
                      f"defines {', '.join(defined) or 'no functions or classes'}")
  obj = getattr(module, name)
  if not callable(obj):
    kind = type(obj).__name__
    raise ConfigError(f"{flag} {spec!r}: {name} is {'an' if kind[0] in 'aeiou' else 'a'} "
                      f"{kind}, not callable")
  return obj


def _checked(made: Callable, spec: str) -> Callable[[], nnx.Module]:
  """A no-argument factory that refuses anything but an nnx.Module."""
  try:  # a class's own __init__ (an nnx.Module's metaclass hides it behind *args)
    sig = inspect.signature(made.__init__ if isinstance(made, type) else made)
    params = dict(list(sig.parameters.items())[isinstance(made, type):])
  except (TypeError, ValueError):
    params = {}
  rngs = "rngs" in params and params["rngs"].default is inspect.Parameter.empty
  required = [n for n, p in params.items() if n != "rngs" and p.default is p.empty and
              p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  if required:
    raise ConfigError(f"--model {spec!r}: it needs {', '.join(required)}; a factory takes no "
                      f"arguments but `rngs` (wrap it: def make(): return ...)")

  def factory():
    module = made(rngs=nnx.Rngs(0)) if rngs else made()
    if not isinstance(module, nnx.Module):
      raise ConfigError(f"--model {spec!r}: it returned a {type(module).__name__}, not an "
                        f"nnx.Module")
    return module

  return factory
