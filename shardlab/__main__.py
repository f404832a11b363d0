"""The `shardlab` command (and `python -m shardlab`): restarts for huge pages on a CPU host
(runtime/host_memory.py) before the commands, JAX and the rest of shardlab are imported."""

import sys


def main() -> int:
  command = sys.argv[1:2]
  if command and command[0] not in ("-h", "--help"):
    from shardlab.runtime import host_memory
    host_memory.cpu_entry_point()
  from shardlab.cli import main as cli_main
  return cli_main()


if __name__ == "__main__":
  sys.exit(main())
