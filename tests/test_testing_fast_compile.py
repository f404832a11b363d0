"""`--shardlab-fast-compile` (or `shardlab_fast_compile = true`): XLA:CPU's older loop emitters
at LLVM level 1 for a pytest session and the processes its tests start
(shardlab/testing/fast_compile.py)."""

import os

from shardlab.testing import fast_compile

USER_TEST = """
import os, subprocess, sys
import jax, jax.numpy as jnp

def test_flags():
    # XLA refuses a flag it does not know: a computation running proves it was read.
    assert float(jax.jit(lambda x: jnp.sin(x).sum())(jnp.ones(8))) > 0
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['XLA_FLAGS'])"],
                           check=True, capture_output=True, text=True).stdout
    print("FLAGS", os.environ.get("XLA_FLAGS", ""), "| CHILD", child.strip())
"""


def _without_the_flag(monkeypatch, extra: str = "") -> None:
  """The suite itself runs with the flags (pyproject.toml); the sessions here start without."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if f not in fast_compile.FLAGS)
  monkeypatch.setenv("XLA_FLAGS", f"{flags} {extra}".strip())


def _flags_line(result) -> str:
  line = next(line for line in result.stdout.lines if "FLAGS " in line)
  return line[line.index("FLAGS "):]


def test_option_and_ini_pass_the_flag_to_xla_and_to_child_processes(pytester, monkeypatch):
  _without_the_flag(monkeypatch)
  pytester.makepyfile(test_user=USER_TEST)
  off = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
  off.assert_outcomes(passed=1)
  assert not any(flag in _flags_line(off) for flag in fast_compile.FLAGS)
  on = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--shardlab-fast-compile")
  on.assert_outcomes(passed=1)
  mine, child = _flags_line(on).split("| CHILD")
  assert all(flag in mine and flag in child for flag in fast_compile.FLAGS), (mine, child)
  pytester.makeini("[pytest]\nshardlab_fast_compile = true\n")
  ini = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
  ini.assert_outcomes(passed=1)
  assert all(flag in _flags_line(ini) for flag in fast_compile.FLAGS)


def test_a_choice_already_in_xla_flags_is_kept(pytester, monkeypatch):
  _without_the_flag(monkeypatch, "--xla_cpu_use_fusion_emitters=true")
  pytester.makepyfile(test_user=USER_TEST)
  result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider",
                                         "--shardlab-fast-compile")
  result.assert_outcomes(passed=1)
  line = _flags_line(result)
  emitters, level = fast_compile.FLAGS
  assert "--xla_cpu_use_fusion_emitters=true" in line and emitters not in line
  assert level in line  # the option the user left unset is still added


def test_only_keeps_the_fast_compile_flags_alone():
  env = {"XLA_FLAGS": " ".join(("--xla_force_host_platform_device_count=8",
                                *fast_compile.FLAGS)), "OTHER": "1"}
  assert fast_compile.only(env) == " ".join(fast_compile.FLAGS)
  assert fast_compile.only({"OTHER": "1"}) == ""


def test_a_backend_already_started_is_refused(pytester, monkeypatch):
  _without_the_flag(monkeypatch)
  pytester.makepyfile(early_jax="import jax\njax.devices()\n", test_user=USER_TEST)
  pytester.syspathinsert()
  result = pytester.runpytest_subprocess("-p", "early_jax", "--shardlab-fast-compile")
  assert result.ret != 0
  result.stderr.fnmatch_lines(["*--shardlab-fast-compile: the JAX backend already started*"])
