"""runtime.host_memory: when a CPU entry point restarts itself with huge pages, and that it
restarts once."""

import os
import subprocess
import sys

import pytest

from shardlab.runtime import host_memory as hm


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"),
                                        ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never"),
                                        ("garbled\n", None)])
def test_thp_mode_reads_the_bracketed_choice(tmp_path, text, mode):
  path = tmp_path / "enabled"
  path.write_text(text)
  assert hm.thp_mode(str(path)) == mode
  assert hm.thp_mode(str(tmp_path / "missing")) is None


def test_huge_page_env_adds_the_tunable_only_where_it_changes_something():
  assert hm.huge_page_env({"A": "1"}, "madvise") == {"A": "1", "GLIBC_TUNABLES": hm.TUNABLE}
  # The user's own tunables are kept, ours appended.
  assert hm.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.check=0"}, "madvise") == {
      "GLIBC_TUNABLES": f"glibc.malloc.check=0:{hm.TUNABLE}"}
  assert hm.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise") is None
  assert hm.huge_page_env({hm.OPT_OUT: "0"}, "madvise") is None
  for mode in ("always", "never", None):  # THP already on for every block, or off
    assert hm.huge_page_env({}, mode) is None


SCRIPT = """
import os, sys
from shardlab.runtime import host_memory
print("start", sys.argv[1:], flush=True)
host_memory.reexec_with_huge_pages()
print("tunables", os.environ.get("GLIBC_TUNABLES"))
"""


def _run(env_extra: dict) -> list[str]:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hm.OPT_OUT)}
  out = subprocess.run([sys.executable, "-c", SCRIPT, "x", "y"], env={**env, **env_extra},
                       capture_output=True, text=True, check=True, timeout=120)
  return out.stdout.splitlines()


@pytest.mark.skipif(hm.thp_mode() != "madvise" or not sys.platform.startswith("linux"),
                    reason="the restart happens only where THP is in madvise mode")
def test_restarts_once_with_the_same_arguments():
  assert _run({}) == ["start ['x', 'y']", "start ['x', 'y']", f"tunables {hm.TUNABLE}"]


def test_no_restart_when_opted_out_or_already_set():
  assert _run({hm.OPT_OUT: "0"}) == ["start ['x', 'y']", "tunables None"]
  assert _run({"GLIBC_TUNABLES": hm.TUNABLE}) == ["start ['x', 'y']", f"tunables {hm.TUNABLE}"]
