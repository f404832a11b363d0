"""`shardlab plan` and `shardlab inspect` with `--model file.py:NAME` / `package.module:NAME`:
a user's own module (examples/mixer.py's Mixer) planned as `sl.plan_module` plans it, its
parameters sharded as `sl.shardings` shards them, and a clear error for each wrong value."""

import json
import math
import re
import sys
import textwrap
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

import shardlab as sl
from shardlab import cli
from shardlab.config import TrainConfig
from shardlab.training import optim
from shardlab.plan.training import layout

ROOT = Path(__file__).resolve().parents[1]
MIXER = str(ROOT / "examples" / "mixer.py")
MESH = "data:2,fsdp:2,tensor:2"


@pytest.fixture(scope="module")
def mixer():
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    import mixer
  finally:
    sys.path.remove(str(ROOT / "examples"))
  return mixer


def _run(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def test_plan_of_a_factory_is_plan_module(capsys, mixer):
  """The CLI's figures are sl.plan_module's for the same module, loss, batch and mesh."""
  code, out, err = _run(capsys, "plan", "--model", f"{MIXER}:Mixer", "--mesh", MESH,
                        "--strategy", "fsdp_tp", "--global-batch", "32", "--precision",
                        "fp32", "--optimizer", "adamw", "--json")
  assert code == 0, err
  got = json.loads(out)
  opt = optim.make(TrainConfig(optimizer="adamw"))  # train.py's: clipping, its schedule
  want = sl.plan_module(lambda: mixer.Mixer(nnx.Rngs(0)), opt, "fp32",
                        "fsdp_tp", sl.mesh(MESH), batch=mixer.batch_shapes(32),
                        loss_fn=mixer.loss_fn)
  for key in ("params", "master", "grads", "opt_state", "batch", "activations",
              "temporaries", "total", "arguments"):
    assert got[key] == pytest.approx(getattr(want, key), rel=1e-12), key
  # AdamW's two moments are split as the params are; the rest is the step counters
  # (int32 scalars, whole on every device).
  assert got["opt_state"] - 2 * got["params"] in (4, 8, 12)
  assert got["fits"] and got["target"] == "h100-80g"
  assert got["strategy"] == "fsdp_tp" and got["microbatches"] == 1


def test_plan_table_and_package_module_form(capsys, tmp_path, monkeypatch):
  """`package.module:NAME`, and the default loss_fn / batch_shapes found beside it."""
  pkg = tmp_path / "mypkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "models.py").write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp
      from flax import nnx
      import shardlab as sl

      class Tiny(nnx.Module):
        def __init__(self, rngs):
          self.w = sl.param(jnp.zeros((16, 32)), ("embed", "mlp"))
        def __call__(self, x):
          return x @ self.w[...]

      def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

      def batch_shapes(size):
        return {"x": jax.ShapeDtypeStruct((size, 16), jnp.float32)}
      """))
  monkeypatch.syspath_prepend(str(tmp_path))
  code, out, err = _run(capsys, "plan", "--model", "mypkg.models:Tiny", "--devices", "4",
                        "--global-batch", "8", "--precision", "fp32")
  assert code == 0, err
  assert re.search(r"plan for fsdp on [a-z:1,]*fsdp:4[a-z:1,]* on cpu, precision fp32", out)
  assert "fits on h100-80g" in out
  assert "params (working copy)" in out and "largest saved residuals" in out
  code, out, err = _run(capsys, "plan", "--model", "mypkg.models:Tiny", "--devices", "4",
                        "--global-batch", "8", "--precision", "fp32", "--json")
  assert code == 0, err
  # 512 fp32 params over fsdp 4 (dim 0, 16 rows: 4 each): 512 B per device.
  assert json.loads(out)["params"] == 512


def test_inspect_of_a_factory_shards_as_sl_shardings(capsys, mixer):
  code, out, err = _run(capsys, "inspect", "--model", f"{MIXER}:Mixer", "--mesh", MESH,
                        "--strategy", "fsdp_tp", "--json")
  assert code == 0, err
  got = json.loads(out)
  abstract = sl.abstract_state(lambda: mixer.Mixer(nnx.Rngs(0)), optax.adamw(1e-3), "fp32")
  sh = sl.shardings(abstract, sl.strategy("fsdp_tp"), sl.mesh(MESH))
  flat = jax.tree_util.tree_flatten_with_path(sh.state.params)[0]
  want = {layout._keystr(path): s.spec for path, s in flat}
  rows = {r["path"]: r for r in got["params"]}
  assert set(rows) == set(want) and len(rows) == 14
  mesh_shape = dict(sl.mesh(MESH).shape)
  total = 0
  for path, spec in want.items():
    r = rows[path]
    assert r["spec"] == layout._spec_text(spec), path
    split = math.prod(mesh_shape[a] for axes in spec if axes
                      for a in (axes if isinstance(axes, tuple) else (axes,)))
    assert r["local_bytes"] == math.prod(r["shape"]) * 4 // split, path
    total += r["local_bytes"]
  assert sum(math.prod(r["shape"]) for r in rows.values()) == 38_784
  assert got["bytes_per_device"]["params"] == total


@pytest.mark.parametrize("value, words", [
    ("examples/nope.py:Mixer", ["examples/nope.py:Mixer", "no file"]),
    ("examples/mixer.py:Mixr", ["examples/mixer.py:Mixr", "no 'Mixr'", "Mixer"]),
    ("examples/mixer.py:PATCHES", ["examples/mixer.py:PATCHES", "an int, not callable"]),
    ("examples/mixer.py:make_batch", ["make_batch", "needs seed, size"]),
    ("examples/mixer.py:loss_fn", ["loss_fn", "needs model, batch"]),
    ("no_such_pkg.models:Net", ["no_such_pkg.models:Net", "cannot import"]),
])
def test_a_wrong_factory_is_named(capsys, monkeypatch, value, words):
  monkeypatch.chdir(ROOT)
  for command in ("plan", "inspect"):
    code, _, err = _run(capsys, command, "--model", value, "--mesh", MESH)
    assert code == 2, (command, err)
    assert err.startswith("error: --model ") and "Traceback" not in err
    for w in words:
      assert w in err, (command, w, err)


def test_a_factory_that_returns_no_module(capsys, tmp_path):
  path = tmp_path / "bad.py"
  path.write_text("def make():\n  return {'w': 1}\n")
  code, _, err = _run(capsys, "inspect", "--model", f"{path}:make", "--mesh", MESH)
  assert code == 2
  assert f"--model '{path}:make': it returned a dict, not an nnx.Module" in err


def test_missing_loss_and_flags_that_do_not_apply(capsys, tmp_path):
  code, _, err = _run(capsys, "plan", "--model", f"{MIXER}:Mixer", "--mesh", MESH,
                      "--batch-fn", "make_batches")
  assert code == 2 and "--batch-fn 'make_batches'" in err and "batch_shapes" in err
  code, _, err = _run(capsys, "plan", "--model", f"{MIXER}:Mixer", "--mesh", MESH,
                      "--seq-len", "128")
  assert code == 2 and "--seq-len does not apply to a module factory" in err


def test_search_of_a_factory_is_auto_layout(capsys, mixer):
  """--search runs the module search (sl.auto_layout's) on simulated devices, compiling the
  best by estimate."""
  code, out, err = _run(capsys, "plan", "--model", f"{MIXER}:Mixer", "--devices", "2",
                        "--strategy", "fsdp", "--global-batch", "16", "--search",
                        "--compile-top", "1", "--precision", "fp32", "--json")
  assert code == 0, err
  got = json.loads(out)
  compiled = [c for c in got["candidates"] if c["compiled_bytes"] is not None]
  assert len(compiled) == 1 and compiled[0]["verdict"] == "fits"
  assert (got["strategy"], got["mesh"]) == (compiled[0]["strategy"], compiled[0]["mesh"])
  assert {c["strategy"] for c in got["candidates"]} == {"fsdp"}
