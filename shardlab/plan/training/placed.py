"""An abstract state and its placements, each computed once for every estimate that needs it.

A fewest-devices scan estimates each (strategy, mesh) at every microbatch count it tries
(eleven for a batch of 1024), and the seed-question table runs twelve scans: 17,000
estimates. The state's shape depends on none of the microbatches, the batch or the
sequence, and its shardings, and what the planner derives from them alone (bytes per device,
each param's axes under every table), only on the strategy and the mesh. Computed afresh
they were half of every estimate's time.
"""

import functools
from typing import Any, Callable

from jax.sharding import AbstractMesh

from shardlab.sharding import rules as rules_lib
from shardlab.training import state as state_lib


class Placed:
  """One strategy's shardings of the state on one mesh, and what is derived from them."""

  def __init__(self, abstract: state_lib.Abstract, rules: rules_lib.Rules,
               mesh: AbstractMesh):
    self.abstract, self.rules, self.mesh = abstract, rules, mesh
    self._derived: dict = {}

  @functools.cached_property
  def shardings(self) -> state_lib.Shardings:
    return state_lib.shardings(self.abstract, self.rules, self.mesh)

  def derived(self, key: tuple, make: Callable[[], Any]) -> Any:
    """`make()`'s result, computed the first time `key` is asked for. `key` names everything
    it depends on besides this placement. The result is shared: never modify it."""
    if key not in self._derived:
      self._derived[key] = make()
    return self._derived[key]


class State:
  """An abstract state (`abstract`) with the placements estimated for it so far."""

  def __init__(self, abstract: state_lib.Abstract):
    self.abstract = abstract
    self._placed: dict[tuple, Placed] = {}

  def placed(self, rules: rules_lib.Rules, mesh: AbstractMesh) -> Placed:
    """The placement of `rules` on `mesh` (rules with the same name and tables are one)."""
    key = (repr(rules), mesh)
    if key not in self._placed:
      self._placed[key] = Placed(self.abstract, rules, mesh)
    return self._placed[key]
