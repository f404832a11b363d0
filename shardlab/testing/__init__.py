"""Helpers for unit-testing your own sharded JAX code on a CPU (see docs/testing.md).

Turn on the pytest plugin with `--shardlab-devices 8` or `shardlab_devices = 8` in your
pytest ini: it sets up simulated CPU devices before JAX starts, and gives the `mesh`
fixture. The assertions work with or without it.
"""

from shardlab.testing.assertions import assert_no_replicated_above, assert_placement
from shardlab.testing.assertions import assert_sharded_matches_single_device
from shardlab.testing.collectives import assert_collectives, bytes_per_device, collectives
from shardlab.testing.explain import assert_no_collective, assert_no_unplanned_collectives
from shardlab.testing.processes import launch

__all__ = ["assert_collectives", "assert_no_collective", "assert_no_replicated_above",
           "assert_no_unplanned_collectives", "assert_placement",
           "assert_sharded_matches_single_device", "bytes_per_device", "collectives", "launch"]
