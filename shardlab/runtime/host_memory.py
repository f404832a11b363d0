"""Transparent huge pages for XLA:CPU's buffers (Linux, glibc).

XLA:CPU allocates each program's temporaries afresh on every run: one block per device of
about the compiled temp size (94 MiB on the peer benchmark), which glibc serves with mmap
and returns with munmap. Touched again each step in 4 KiB pages, that is one page fault a
page: 22% of the peer step's CPU time went to faulting and unmapping (perf). With
`glibc.malloc.hugetlb=1` glibc asks for transparent huge pages on such blocks (madvise),
which on kernels whose THP mode is `madvise` (the common default) cuts the faults 512-fold.
glibc reads its tunables only when a process starts, so a CPU entry point re-executes itself
once with the tunable set; `SHARDLAB_HUGE_PAGES=0` turns that off. It does so before it
imports JAX or the rest of shardlab (`cpu_entry_point`, light to import): importing them
first cost about 2 s of CPU a command, paid twice.
"""

import os
import signal
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "SHARDLAB_HUGE_PAGES"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE) -> str | None:
  """The kernel's THP mode ('always', 'madvise', 'never'), or None where it has none."""
  try:
    text = Path(path).read_text()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def huge_page_env(environ, mode: str | None) -> dict | None:
  """`environ` with the tunable added, or None where it would change nothing: THP off or
  already on for every block, the tunable already set, or the user's opt-out."""
  if mode != "madvise" or environ.get(OPT_OUT, "1") == "0":
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb=" in tunables:
    return None
  return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def cpu_entry_point() -> None:
  """First thing in a command-line entry point: on a host without accelerators, restart with
  huge pages for XLA:CPU's buffers. A no-op in the restarted process (the tunable is set)."""
  from shardlab.runtime.accelerators import accelerator_present
  if not accelerator_present():
    reexec_with_huge_pages()


def reexec_with_huge_pages() -> None:
  """Restarts this process with the tunable set, when it would help (see huge_page_env).
  Call it first thing in a program's entry point: the process is replaced. A Ctrl-C during
  the restart is held (SIGINT blocked across execve) and raised as KeyboardInterrupt by the
  new process's call here, where its entry point handles it: neither lost nor a crash of
  the new interpreter's start-up."""
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
  try:
    glibc = sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
  except (ValueError, OSError):  # a C library without that name (musl)
    glibc = False
  if not glibc:
    return
  env = huge_page_env(os.environ, thp_mode())
  if env is not None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
  """One line for a benchmark's header: what this process runs with."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  return (f"host memory: THP mode {thp_mode()}, GLIBC_TUNABLES={tunables or '(unset)'} "
          f"(runtime/host_memory.py)")
