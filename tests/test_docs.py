"""Docs whose snippets claim to run as written: every ```python block, in order, in one
namespace (a snippet builds on the ones before it)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_doc(name: str) -> dict:
  text = (ROOT / "docs" / name).read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert blocks, f"docs/{name} has no python snippet"
  namespace: dict = {"__name__": f"docs_{name.replace('.', '_').replace('-', '_')}"}
  for i, block in enumerate(blocks):
    exec(compile(block, f"docs/{name} (snippet {i + 1})", "exec"), namespace)
  return namespace


def test_parallel_building_blocks_run_as_written(capsys):
  ns = run_doc("parallel.md")
  out = capsys.readouterr().out
  assert float(out.split("flash vs dense, window 16: ")[1].split()[0]) < 1e-5
  # The user's decoder under ring context parallelism and a pipeline trains as on one device.
  for got in (ns["ring"], ns["piped"]):
    assert abs(got[-1] - ns["one"][-1]) < 1e-5 * abs(ns["one"][-1])
  assert ns["one"][-1] < ns["one"][0]
  assert abs(float(ns["whole"]) - float(ns["chunked"])) < 1e-5
  assert ns["y"].shape == (2, 8, 32)


def test_lora_for_any_module_runs_as_written(capsys):
  ns = run_doc("lora.md")
  out = capsys.readouterr().out
  losses = [float(v) for v in out.split("loss ")[1].splitlines()[0].split()]
  assert losses[-1] < losses[0]
  assert "merged matches: True" in out
  trained = out.split("trained: ")[1].splitlines()[0]
  assert "lora_a" in trained and "base" not in trained
  assert ns["merged"] is not None
