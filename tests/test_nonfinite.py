"""A diverging run (train.lr 1e5 on the small model: non-finite from step 5 on) stops with
exit code 3 and saves nothing past the last finite step, or skips the bad updates."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from shardlab.cli import train as train_cli
from shardlab.models import lm
from shardlab.sharding import mesh
from shardlab.training import checkpoint, step as step_lib
from shardlab.training import nonfinite
from shardlab.training import run as run_lib
from test_checkpoint import SMALL, final_params, small_config

DIVERGING = ["train.lr=1e5", "train.steps=8"]


def train_cli_args(*sets: str, extra: tuple[str, ...] = ()) -> list[str]:
  return [a for s in SMALL + DIVERGING + list(sets) for a in ("--set", s)] + \
      ["--quiet", "--sample-tokens", "0", *extra]


def saved_steps(directory) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_stop_policy_exits_3_and_keeps_the_last_finite_checkpoint(tmp_path, capsys,
                                                                    monkeypatch):
  # keep=2 and a save every 2 steps: without the guard, retention would keep only the NaN
  # checkpoints 6 and 8. The check before the save at 6 catches step 5 (no log there).
  fetched, fetch = [], nonfinite.NonFiniteGuard.fetch
  monkeypatch.setattr(nonfinite.NonFiniteGuard, "fetch",
                      lambda self: fetched.append(fetch(self)["step"]) or fetch(self))
  directory = tmp_path / "ckpt"
  rc = train_cli.train_main(train_cli_args(
      "checkpoint.every=2", "checkpoint.keep=2", "train.log_every=4",
      extra=("--checkpoint-dir", str(directory))))
  err = capsys.readouterr().err
  assert rc == 3, err
  assert "error: step 5: the loss or gradient norm is not finite" in err
  assert "grad_norm nan" in err and "stopped without saving step 5 or later" in err
  assert f"Last good checkpoint: step 4 in {directory}" in err
  assert "lower train.lr (now 100000)" in err and "raise train.warmup_steps (now 2)" in err
  assert saved_steps(directory) == [2, 4]
  assert fetched == [0, 1, 2, 4, 6]  # the host reads the counts only at saves and log steps
  cfg = small_config(tmp_path, train__lr=1e5)
  step, params = final_params(directory, cfg)
  assert step == 4 and all(np.isfinite(p).all() for p in jax.tree.leaves(params))


def test_skip_policy_leaves_the_state_as_it_was_and_counts(tmp_path, capsys):
  directory, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
  rc = train_cli.train_main(train_cli_args(
      "train.nonfinite=skip", "checkpoint.every=2", "train.log_every=1",
      extra=("--checkpoint-dir", str(directory), "--metrics-file", str(metrics))))
  out = capsys.readouterr().out
  assert rc == 0
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  records = [r for r in records if "loss" in r]  # the step records, not the final eval_loss
  bad = [not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])) for r in records]
  assert [r["skipped"] for r in records] == list(np.cumsum(bad))  # a running total
  assert sum(bad) >= 2 and f"warning: {sum(bad)} non-finite step(s) skipped so far" in out
  # Between two saves with only skipped steps, params and optimizer state stay bit for bit.
  cfg = small_config(tmp_path, train__nonfinite="skip")
  abstract = run_lib.abstract_state(cfg)
  sh = run_lib.shardings(cfg, abstract, mesh.build(mesh.load(cfg.mesh)))
  ckpt = checkpoint.Checkpointer(str(directory))
  states = {s: jax.tree.map(np.asarray, ckpt.restore(abstract, sh, step=s)[0])
            for s in saved_steps(directory)}
  ckpt.close()
  pairs = [(a, b) for a, b in zip(states, list(states)[1:]) if all(bad[a:b])]
  assert pairs, (bad, list(states))
  for a, b in pairs:
    jax.tree.map(np.testing.assert_array_equal, (states[a].params, states[a].opt_state),
                 (states[b].params, states[b].opt_state))
  assert all(np.isfinite(x).all() for s in states.values() for x in jax.tree.leaves(s.params))


def test_skip_policy_stops_after_max_skipped_in_a_row(tmp_path, capsys):
  rc = train_cli.train_main(train_cli_args("train.nonfinite=skip", "train.max_skipped=2"))
  err = capsys.readouterr().err
  assert rc == 3, err
  assert "error: steps 5-6: 2 non-finite steps in a row (train.max_skipped 2" in err
  assert "No checkpoint was kept (no --checkpoint-dir)" in err


def test_skip_step_applies_no_update_on_a_non_finite_loss(tmp_path):
  """The jitted step itself: a NaN loss leaves params and optimizer state untouched (the
  step counter advances); the next finite batch updates them."""
  cfg = dataclasses.replace(small_config(tmp_path, train__nonfinite="skip"), mesh="data:1",
                            strategy="dp")  # one device: the gate does not depend on it
  run = run_lib.setup(cfg, devices=jax.devices()[:1])
  # Poisoned batches carry a negative token: the loss turns NaN, nothing else changes.
  poisoned = lambda model, tokens: lm.next_token_loss(model, tokens) * jnp.where(
      (tokens < 0).any(), jnp.nan, 1.0)
  train_step = step_lib.make_train_step(poisoned, run.abstract, run.shardings,
                                        nonfinite="skip")
  good = run.batch(run.corpus.train, 0, 0)
  bad = jax.device_put(np.asarray(good) * 0 - 1, run.shardings.batch)
  state = run_lib.init(run)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  state, metrics = train_step(state, bad)
  assert not bool(metrics["finite"]) and int(metrics["skipped"]) == 1
  assert int(state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, (state.params, state.opt_state)))
  state, metrics = train_step(state, good)
  assert bool(metrics["finite"]) and int(metrics["skipped"]) == 0
  # The first update has lr 0 (warmup), but Adam's moments and count move.
  after = jax.tree.leaves(jax.tree.map(np.asarray, state.opt_state))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[1]), after))
