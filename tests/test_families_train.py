"""Every registered architecture trains under fsdp × tensor parallelism as on one device:
the same losses over two steps on one batch (the second lower), so each family's params are
named, placed and reduced right (tests/test_protocol.py's small model file of each)."""

import numpy as np
import pytest

import helpers as H
from test_protocol import ARCHS, small


# llama is tests/test_parity.py's model under every strategy, and the qkv-bias variant has
# its own such test (tests/test_protocol.py): every other architecture here.
COVERED = {"llama", "llama-qkv-bias"}


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in COVERED])
def test_every_architecture_trains_sharded_as_on_one_device(arch):
  model = small(arch)
  runs = {"sharded": H.run("fsdp_tp", model=model, warmup_steps=0),
          "one": H.run("dp", "data:1", model=model, warmup_steps=0)}
  losses = {}
  for name, r in runs.items():
    state, batch, losses[name] = r.fresh_state(), r.batch(0), []
    for _ in range(2):  # the same batch twice: the second loss must be lower
      state, metrics = r.compiled_step(state, batch)
      losses[name].append(float(metrics["loss"]))
  assert losses["one"][1] < losses["one"][0], losses
  np.testing.assert_allclose(losses["sharded"], losses["one"], rtol=1e-5, err_msg=arch)
