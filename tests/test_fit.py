"""sl.fit: a user's own module through train.py's loop (training/driver.py) on 8 simulated
devices: run-dir outputs, checkpoint cadence, exact resume (the data position restored) and
parity with a hand-written loop over sl.train_step."""

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardlab as sl

STEPS, ROWS, D = 6, 16, 8


class TwoLayer(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, hidden: int = 16):
    init = nnx.initializers.lecun_normal()
    self.w1 = sl.param(init(rngs.params(), (D, hidden)), ("embed", "mlp"))
    self.w2 = sl.param(init(rngs.params(), (hidden, 1)), ("mlp", None))

  def __call__(self, x_BxD):
    return (jax.nn.relu(x_BxD @ self.w1[...]) @ self.w2[...])[:, 0]


def loss_fn(model, batch):
  error = model(batch["x"]) - batch["y"]
  return jnp.mean(error**2), {"max_error": jnp.abs(error).max()}


def batch(step: int) -> dict:
  """Batch `step`: a different one at every step, the same at every call."""
  x = np.random.default_rng(step).normal(size=(ROWS, D)).astype(np.float32)
  return {"x": x, "y": np.sin(x.sum(axis=1))}


class Stream:
  """An iterator of batches whose position a checkpoint holds."""

  def __init__(self):
    self.position = 0

  def __iter__(self):
    return self

  def __next__(self):
    self.position += 1
    return batch(self.position - 1)

  def state(self) -> dict:
    return {"position": self.position}

  def restore(self, state: dict) -> None:
    self.position = state["position"]


HELD_OUT = [batch(10_000), batch(10_001)]
factory = lambda: TwoLayer(nnx.Rngs(0))
optimizer = lambda: optax.adamw(1e-2)


@pytest.fixture(scope="module")
def mesh():
  return sl.mesh("data:2,fsdp:2,tensor:2")


def run(data, mesh, **options):
  return sl.fit(factory, loss_fn, optimizer(), data, steps=STEPS, mesh=mesh,
                strategy="fsdp_tp", quiet=True, **options)


def records(run_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def same_params(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(a)),
                                                   jax.tree.leaves(jax.device_get(b))))


@pytest.fixture(scope="module")
def straight(mesh, tmp_path_factory):
  """An uninterrupted run, every step logged: (final state, its run dir)."""
  run_dir = tmp_path_factory.mktemp("straight")
  state, _ = run(batch, mesh, log_every=1, run_dir=str(run_dir))
  return state, run_dir


def test_run_dir_cadence_and_parity(mesh, tmp_path):
  """metrics.jsonl holds the logged steps, the periodic and the final held-out loss (its last
  line); TensorBoard events and plot.png are written; checkpoints follow the cadence (and
  the last step); the losses and params equal a hand-written loop over sl.train_step."""
  ckpt = tmp_path / "ckpt"
  state, summary = run(batch, mesh, log_every=2, eval_data=HELD_OUT, eval_every=3,
                       run_dir=str(tmp_path), checkpoint_dir=str(ckpt), checkpoint_every=4,
                       microbatches=2)
  lines = records(tmp_path)
  assert sorted(losses(tmp_path)) == [1, 2, 4, 6]  # step 1, then every log_every
  assert all("max_error" in r and "grad_norm" in r for r in lines if "loss" in r)
  evals = [(r["step"], r["eval_loss"]) for r in lines if "eval_loss" in r]
  assert [s for s, _ in evals] == [3, 6] and lines[-1] == {"step": 6, "eval_loss": evals[-1][1]}
  assert summary["held_out_loss"] == evals[-1][1] and summary["steps_done"] == STEPS
  assert list(tmp_path.glob("events.out.tfevents.*")) and (tmp_path / "plot.png").stat().st_size
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 6]

  # The same run by hand, with the public step API.
  abstract = sl.abstract_state(factory, optimizer(), "fp32")
  shardings = sl.shardings(abstract, sl.strategy("fsdp_tp"), mesh)
  hand = sl.init(abstract, shardings)
  step = sl.train_step(loss_fn, abstract, shardings, microbatches=2)
  by_hand = {}
  for k in range(STEPS):
    hand, metrics = step(hand, jax.device_put(batch(k), shardings.batch))
    by_hand[k + 1] = float(metrics["loss"])
  assert losses(tmp_path) == {k: by_hand[k] for k in (1, 2, 4, 6)}
  assert same_params(state.params, hand.params)
  evaluate = sl.eval_step(loss_fn, abstract, shardings, microbatches=2)
  held_out = np.mean([float(evaluate(hand.params, jax.device_put(b, shardings.batch)))
                      for b in HELD_OUT])
  assert evals[-1][1] == pytest.approx(held_out, rel=1e-6)


class Preempted(Stream):
  """A Stream whose host gets a SIGTERM while batch 2 (step 3's) is made."""

  def __next__(self):
    if self.position == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return super().__next__()


@pytest.mark.parametrize("kind,stop", [("function", "stop_after"), ("iterator", "stop_after"),
                                       ("iterator", "SIGTERM")])
def test_resume_is_exact(kind, stop, mesh, straight, tmp_path):
  """Stopped after step 3 (saved there: --stop-after, or a SIGTERM) and rerun: the resumed
  steps' losses and the final params are bit-identical to the uninterrupted run's; an
  iterator continues from its saved position, not from its start (batches are built ahead
  in a thread: the position saved is step 4's batch's, not the iterator's)."""
  data = {"function": lambda: batch, "iterator": Stream}[kind]
  ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
  if stop == "SIGTERM":  # made in the loop's thread (no prefetch): the stop lands at step 3
    _, summary = run(Preempted(), mesh, log_every=1, run_dir=str(first),
                     checkpoint_dir=str(ckpt), prefetch=0)
    assert summary["stopped_by"] == "SIGTERM"
  else:
    _, summary = run(data(), mesh, log_every=1, run_dir=str(first), checkpoint_dir=str(ckpt),
                     stop_after=3)
  assert summary["steps_done"] == 3 and "held_out_loss" not in summary
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [3]
  state, summary = run(data(), mesh, log_every=1, run_dir=str(second),
                       checkpoint_dir=str(ckpt))
  assert summary["steps_this_run"] == STEPS - 3
  straight_state, straight_dir = straight
  expected = losses(straight_dir)
  assert losses(first) == {k: expected[k] for k in (1, 2, 3)}
  assert losses(second) == {k: expected[k] for k in (4, 5, 6)}
  assert same_params(state.params, straight_state.params)


def test_refusals(mesh, tmp_path):
  """Settings that cannot work are refused, named as fit's arguments."""
  with pytest.raises(sl.ConfigError, match=r"sl.fit: steps must be >= 1"):
    sl.fit(factory, loss_fn, optimizer(), batch, steps=0, mesh=mesh)
  with pytest.raises(sl.ConfigError, match="eval_every=2 needs eval_data"):
    sl.fit(factory, loss_fn, optimizer(), batch, steps=2, mesh=mesh, eval_every=2)
  with pytest.raises(sl.ConfigError, match="checkpoint_every must be >= 1"):
    sl.fit(factory, loss_fn, optimizer(), batch, steps=2, mesh=mesh, checkpoint_every=0)
  with pytest.raises(sl.ConfigError, match="sl.fit: unknown nonfinite 'ignore'; valid"):
    sl.fit(factory, loss_fn, optimizer(), batch, steps=2, mesh=mesh, nonfinite="ignore")
  with pytest.raises(sl.ConfigError, match="unknown logger 'tensorbord'"):
    sl.fit(factory, loss_fn, optimizer(), batch, steps=2, mesh=mesh, loggers="tensorbord")
  # A plain iterator cannot say where it stands: no exact resume, so no checkpointing.
  with pytest.raises(sl.ConfigError, match=r"without state\(\) and restore\(state\)"):
    sl.fit(factory, loss_fn, optimizer(), iter([batch(0)]), steps=2, mesh=mesh,
           checkpoint_dir=str(tmp_path / "ckpt"), quiet=True)
