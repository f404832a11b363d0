"""docs/serving.md answers the seed question with the planners' own output
(bench/seed_question.py), so the table stays true when the planners change."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script():
  spec = importlib.util.spec_from_file_location("seed_question",
                                                ROOT / "bench" / "seed_question.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def documented() -> str:
  text = (ROOT / "docs" / "serving.md").read_text()
  found = re.search(r"<!-- seed-question:begin -->\n(.*?)\n<!-- seed-question:end -->", text,
                    re.S)
  assert found, "docs/serving.md lost its seed-question markers"
  return found.group(1)


def test_documented_serving_cells_are_the_planners():
  """A fast spot check: one row's serving cells."""
  seed = script()
  row = next(line for line in documented().splitlines()
             if line.startswith("| llama3-70b | h100-80g |"))
  cells = [c.strip() for c in row.strip("|").split("|")][3:]
  assert cells == [seed.serving_cell("llama3-70b", "h100-80g", w, b) for w, b in seed.SERVING]


@pytest.mark.slow
def test_documented_table_is_the_scripts_output():
  assert documented() == script().markdown()
