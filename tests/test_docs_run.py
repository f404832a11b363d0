"""Every command in README.md and docs/ runs as written, at small scale.

Each fenced `sh`/`bash`/`console`/`python` block is run, in order, one doc at a time, unless
a `<!-- not run: REASON -->` line right above it says why not; `<!-- run: SPEC -->` scales a
block down (fewer steps, a tiny model) without changing the text a user copies. The markers,
SPEC and the `console` convention (`$ ` lines are commands, the rest is output and not
compared) are described in tests/docs_blocks.py.

Shell blocks run with bash (`set -e`: a failing line fails the block) in a fresh directory per
doc holding links to the checkout's train.py, examples/, meshes/, bench/, tests/ and .venv, with
`.venv/bin` first on PATH, as for a user who ran `. .venv/bin/activate` in a clone. Python
blocks run in this process (its 8 simulated devices), in that directory, in one namespace per
doc: a later block builds on an earlier one's names and files. Where a doc's output is a
claim (a loss that falls, a parity), a check below asserts it.
"""

import contextlib
import io
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from shardlab.testing import fast_compile
from docs_blocks import (PYTHON, ROOT, SHELL, Block, apply_spec, blocks, commands, docs,
                         with_ci_train)

LINKED = ("train.py", "examples", "meshes", "models", "bench", "tests", "shardlab", ".venv",
          "pyproject.toml", "Makefile")
TIMEOUT_S = 600  # a block's limit; on a loaded 2-core machine a compile can take minutes


def test_every_block_is_run_or_says_why():
  problems = []
  for doc in docs():
    for b in blocks(doc):
      if not b.lang:
        problems.append(f"{b.where}: a fence with no language; name one (sh, console, python "
                        "to run it; text, toml for output or data)")
      elif b.marker == "not run" and not b.spec:
        problems.append(f"{b.where}: `not run:` without a reason")
      elif b.marker == "run" and b.lang not in SHELL | PYTHON:
        problems.append(f"{b.where}: `run:` on a block that is never run")
  assert not problems, "\n".join(problems)


def _env(workdir) -> dict[str, str]:
  # A user's shell: none of this process's device settings (each command sets its own), but
  # the suite's compilation cache where `--shardlab-cache` gave one (JAX_COMPILATION_*) and
  # its faster-compiling XLA:CPU settings (shardlab_fast_compile).
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "PJRT_NPROC")
         and not k.startswith("PYTEST_")}
  venv = str(workdir / ".venv")
  # No restart of each command for huge pages: 2 s of CPU a command, the same results
  # (tests/test_host_memory.py covers the restart).
  env.update(PATH=f"{venv}/bin:{env.get('PATH', '/usr/bin:/bin')}", VIRTUAL_ENV=venv,
             COLUMNS="80", PYTHONUNBUFFERED="1", SHARDLAB_HUGE_PAGES="0")
  env.pop("PYTHONHOME", None)
  flags = fast_compile.only(os.environ)
  if flags:
    env["XLA_FLAGS"] = flags
  return env


def _tail(text: str, lines: int = 25) -> str:
  return "\n".join(text.strip().splitlines()[-lines:])


def _run_shell(b: Block, workdir, env) -> str:
  cmds, extra = apply_spec(b, commands(b))
  cmds = with_ci_train(cmds)
  script = "set -eo pipefail\n" + "\n".join(cmds) + "\n"
  # A session of its own: a timeout ends the block's every process, not only bash.
  proc = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env | extra, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"{b.where} timed out after {TIMEOUT_S} s:\n{script}\n--- stderr (tail):\n"
                f"{_tail(err)}")
  if proc.returncode:
    pytest.fail(f"{b.where} exited {proc.returncode}:\n{script}\n--- stderr (tail):\n"
                f"{_tail(err)}\n--- stdout (tail):\n{_tail(out, 10)}")
  return out


def _alarm(signum, frame):
  raise TimeoutError(f"a python block ran over {TIMEOUT_S} s")


def _run_python(b: Block, namespace: dict) -> str:
  (code,), _ = apply_spec(b, [b.text])
  out = io.StringIO()
  previous = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(TIMEOUT_S)
  try:
    with contextlib.redirect_stdout(out):
      exec(compile(code, f"{b.doc} (block {b.number})", "exec"), namespace)
  except BaseException as e:
    raise AssertionError(f"{b.where} raised {type(e).__name__}: {e}\n{code}\n--- stdout (tail):"
                         f"\n{_tail(out.getvalue(), 10)}") from e
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
  sys.stdout.write(out.getvalue())
  return out.getvalue()


def _cpu_s() -> float:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
      resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_doc(doc: str, workdir) -> tuple[dict, dict[int, str]]:
  """Runs the doc's blocks in order: (the python namespace, each run block's stdout)."""
  for name in LINKED:
    (workdir / name).symlink_to(ROOT / name)
  env = _env(workdir)
  namespace: dict = {"__name__": "docs_" + doc.replace("/", "_").replace(".", "_")}
  outputs = {}
  for b in blocks(doc):
    if b.marker == "not run" or b.lang not in SHELL | PYTHON:
      continue
    start, cpu = time.perf_counter(), _cpu_s()
    if b.lang in SHELL:
      outputs[b.number] = _run_shell(b, workdir, env)
      sys.stdout.write(outputs[b.number])
    else:
      outputs[b.number] = _run_python(b, namespace)
    # Shown by `pytest -s`: wall time, and CPU time (this process and its children), the
    # figure that holds on a loaded machine.
    print(f"[{b.where}: {time.perf_counter() - start:.1f} s, CPU {_cpu_s() - cpu:.1f} s]")
  return namespace, outputs


def _block(doc: str, heading: str) -> int:
  """The number of the first command block after a heading (checks find blocks by it)."""
  text = (ROOT / doc).read_text()
  at = text.index(heading)
  return next(b.number for b in blocks(doc) if b.line > text.count("\n", 0, at) + 1)


def check_readme(ns, out):
  loss = float(out[_block("README.md", "## From Python")].split()[-1])
  assert 5.0 < loss < 7.0  # about ln(256) + 1/2 (logits of unit variance) at init
  # The whole "your own module" snippet (it was a fragment that raised NameError) trains.
  loss = float(out[_block("README.md", "Your own Flax NNX module")].split()[-1])
  assert 0 < loss < 1
  text = (ROOT / "README.md").read_text()
  assert "make train" in text and "make test" in text


def check_parallel(ns, out):
  text = "".join(out.values())
  assert float(text.split("flash vs dense, window 16: ")[1].split()[0]) < 1e-5
  # The user's decoder under ring context parallelism and a pipeline trains as on one device.
  for got in (ns["ring"], ns["piped"]):
    assert abs(got[-1] - ns["one"][-1]) < 1e-5 * abs(ns["one"][-1])
  assert ns["one"][-1] < ns["one"][0]
  assert abs(float(ns["whole"]) - float(ns["chunked"])) < 1e-5
  assert ns["y"].shape == (2, 8, 32)


def check_lora(ns, out):
  text = "".join(out.values())
  losses = [float(v) for v in text.split("loss ")[1].splitlines()[0].split()]
  assert losses[-1] < losses[0]
  assert "merged matches: True" in text
  trained = text.split("trained: ")[1].splitlines()[0]
  assert "lora_a" in trained and "base" not in trained
  assert ns["merged"] is not None


def check_explain(ns, out):
  assert ns["report"].unplanned and "unplanned collective" in "".join(out.values())


CHECKS = {"README.md": check_readme, "docs/parallel.md": check_parallel,
          "docs/lora.md": check_lora, "docs/explain.md": check_explain}


@pytest.mark.parametrize("doc", docs(), ids=lambda d: d.removeprefix("docs/"))
def test_doc_runs_as_written(doc, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))  # as `python` started there: examples/ imports
  namespace, outputs = run_doc(doc, tmp_path)
  if doc in CHECKS:
    CHECKS[doc](namespace, outputs)
