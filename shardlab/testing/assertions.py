"""Assertions about sharded code: it computes what one device computes, and every leaf sits
where its logical names and the rules say."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlab.sharding import rules as rules_lib


def _worst(actual, expected, rtol: float, atol: float, scaled_atol: float) -> str | None:
  """A readable line for the leaf whose failing element is furthest off, or None when all
  are close: |a - e| <= atol + scaled_atol·max|e of the leaf| + rtol·|e|."""
  worst = None
  for (path, a), (_, e) in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                               jax.tree_util.tree_flatten_with_path(expected)[0]):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    where = jax.tree_util.keystr(path) or "output"
    if a.shape != e.shape:
      return f"{where}: shape {a.shape} sharded, {e.shape} on one device"
    scale = np.abs(e).max() if e.size else 0.0
    tol = atol + scaled_atol * scale
    bad = ~np.isclose(a, e, rtol=rtol, atol=tol)
    if bad.any():
      # The worst of the failing elements: the largest difference overall may sit on a large
      # value that rtol allows, and naming it would point at an element that is fine.
      err = np.where(bad, np.abs(a - e), -1.0)
      i = np.unravel_index(int(err.argmax()), err.shape)
      line = (f"{where}: {int(bad.sum())}/{a.size} elements differ; worst at "
              f"{tuple(map(int, i))}: sharded {a[i]:.9g}, one device {e[i]:.9g} "
              f"(|diff| {err[i]:.3g}, allowed {tol + rtol * abs(e[i]):.3g}: atol {atol} + "
              f"scaled_atol {scaled_atol} × max|one device| {scale:.3g} + rtol {rtol} × "
              f"{abs(e[i]):.3g})")
      if worst is None or err[i] > worst[0]:
        worst = (err[i], line)
  return None if worst is None else worst[1]


def _total(fn):
  return lambda *a: sum(x.sum() for x in jax.tree.leaves(fn(*a)))


def assert_sharded_matches_single_device(fn, *args, in_shardings, rtol: float = 1e-5,
                                         atol: float = 0.0, scaled_atol: float = 1e-5,
                                         grad: bool = False, reference=None):
  """Runs `fn(*args)` jitted with `in_shardings` and `reference(*args)` (default: `fn`) on
  one device, and compares the outputs (and with `grad=True` the gradients w.r.t. the first
  argument of their sums): |sharded - one| <= atol + scaled_atol·max|one| + rtol·|one|, per
  leaf. `scaled_atol` is there because a sharded reduction adds in another order: an output
  near zero (a sum of terms that cancel) moves by rounding of the terms' size, not its own,
  which no rtol covers. Give `reference` when `fn` names a mesh itself (shard_map code): the
  plain computation it must equal. Returns the sharded outputs."""
  reference = fn if reference is None else reference
  one_device = jax.device_put(args, jax.devices()[0])  # jit then runs there alone
  pairs = [(fn, reference, "outputs")]
  if grad:
    pairs.append((jax.grad(_total(fn)), jax.grad(_total(reference)), "gradients"))
  sharded_result = None
  for f, ref, what in pairs:
    sharded = jax.jit(f, in_shardings=in_shardings)(*args)
    single = jax.jit(ref)(*one_device)
    if jax.tree.structure(sharded) != jax.tree.structure(single):
      raise AssertionError(f"{what}: tree structures differ")
    problem = _worst(sharded, single, rtol, atol, scaled_atol)
    if problem:
      raise AssertionError(f"sharded {what} differ from one device's: {problem}")
    sharded_result = sharded if sharded_result is None else sharded_result
  return sharded_result


def _expected(names, shape, rules_or_table, mesh: Mesh) -> PartitionSpec:
  table = rules_or_table.params if isinstance(rules_or_table, rules_lib.Rules) else \
      rules_or_table
  return rules_lib.spec(tuple(names), tuple(shape), table, mesh, "leaf")


def _normalized(spec: PartitionSpec, ndim: int) -> tuple:
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    out.append(entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry)
  return tuple(out)


def assert_placement(tree, names, rules, mesh: Mesh) -> None:
  """Every array leaf of `tree` has the sharding its logical names (a tree of name tuples
  with the same structure, e.g. `abstract.names`) get from `rules` (a Rules — its params
  table — or a table dict) on `mesh`. Leaves and names are matched by path: a leaf without
  names (or names without a leaf) is an error, never skipped."""
  is_names = lambda x: isinstance(x, tuple)
  leaves = {jax.tree_util.keystr(p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  named = {jax.tree_util.keystr(p): n
           for p, n in jax.tree_util.tree_flatten_with_path(names, is_leaf=is_names)[0]}
  if leaves.keys() != named.keys():
    raise AssertionError(
        "the names tree does not match the tree: leaves without names "
        f"{sorted(leaves.keys() - named.keys())}, names without a leaf "
        f"{sorted(named.keys() - leaves.keys())}")
  wrong = []
  for path, leaf in leaves.items():
    leaf_names = named[path]
    want = _normalized(_expected(leaf_names, leaf.shape, rules, mesh), leaf.ndim)
    sharding = leaf.sharding
    got = (_normalized(sharding.spec, leaf.ndim) if isinstance(sharding, NamedSharding)
           else repr(sharding))
    if got != want or (isinstance(sharding, NamedSharding) and sharding.mesh != mesh):
      wrong.append(f"{path} {leaf.shape} {tuple(leaf_names)}: placed {got}, rules say {want}")
  if wrong:
    raise AssertionError(f"{len(wrong)} leaves misplaced:\n  " + "\n  ".join(wrong))


def assert_no_replicated_above(tree, nbytes: int) -> None:
  """No array leaf larger than `nbytes` is whole on every device it lives on."""
  whole = [f"{jax.tree_util.keystr(path)} {leaf.shape} {leaf.dtype} ({leaf.nbytes:,} bytes)"
           for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
           if leaf.nbytes > nbytes and leaf.sharding.is_fully_replicated
           and len(leaf.sharding.device_set) > 1]
  if whole:
    raise AssertionError(f"replicated on every device, above {nbytes:,} bytes:\n  " +
                         "\n  ".join(whole))
