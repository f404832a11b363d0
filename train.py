#!/usr/bin/env python3
"""Train a llama-style model on a named device mesh. `python train.py --help` for options."""

import os
import signal
import sys


def interrupted_while_starting(signum, frame):
  # A handler, not KeyboardInterrupt: some library imports run inside bare `except:` blocks
  # that would swallow it, and the run would go on. Nothing has started: nothing to save.
  print("interrupted (Ctrl-C) while starting: nothing was saved", file=sys.stderr, flush=True)
  os._exit(130)


if __name__ == "__main__":
  signal.signal(signal.SIGINT, interrupted_while_starting)
  from shardlab.runtime import host_memory  # light: the restart comes before JAX's import
  host_memory.cpu_entry_point()
  from shardlab.cli import train_main
  sys.exit(train_main())
