"""The README's Python example runs as written (with fewer steps)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_example_runs(capsys):
  code = re.search(r"## From Python\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
  code = code.replace("range(20)", "range(2)")
  exec(compile(code, str(README), "exec"), {})
  loss = float(capsys.readouterr().out.strip().splitlines()[-1])
  assert 5.0 < loss < 7.0  # about ln(256) + 1/2 (logits of unit variance) at init


def test_your_own_module_example_runs(capsys):
  """The snippet after "From Python": a whole module, trained as written (it was a fragment
  that raised NameError)."""
  text = README.read_text()
  code = re.search(r"Your own Flax NNX module.*?```python\n(.*?)```", text, re.S).group(1)
  exec(compile("import shardlab as sl\n" + code, str(README), "exec"), {})
  loss = float(capsys.readouterr().out.strip().splitlines()[-1])
  assert 0 < loss < 1


def test_readme_names_the_two_commands():
  text = README.read_text()
  assert "make train" in text and "make test" in text
