"""The fenced blocks of README.md and docs/*.md, and what tests/test_docs_run.py does with each.

A block is a command block when its fence says `sh`, `bash`, `shell`, `console` (shell) or
`python`; `toml`, `text` and the like are data shown to the reader and never run; a fence
with no language must name one. The last non-blank line above a command block may be

  <!-- not run: REASON -->   never run, and REASON says why (a TPU slice, a cluster, an
                             output listing, a multi-GB model from the Hub, ...)
  <!-- run: SPEC -->         run, scaled down for CI by SPEC (below); the text a user copies
                             stays as written

and a command block with neither is run as written. SPEC is clauses separated by `;`:

  --flag value ...           each flag replaces the same flag's value in every `train.py` /
                             `shardlab` command of the block, or is appended to it; `--set
                             key=value` replaces that key's `--set` (a flag that takes no
                             value: `--flag`)
  train: --flag value ...    the same, only for commands of that `shardlab` subcommand
                             (`train` covers `python train.py`; `shardlab data prepare`
                             is `prepare`)
  NAME=value                 an environment variable for the block
  first: COMMAND             a shell command run before the block, making what it reads
                             (a run directory, a checkpoint) where no earlier block does
  "old" -> "new"             a literal text substitution (the text must occur)

Every training command also gets `CI_TRAIN`'s flags where it does not set them itself: no
end-of-run sample (two more compiles a run) and one held-out batch instead of eight. What a
doc shows a user is still run; tests/test_generate_sharded.py checks the sample itself.

Shell blocks: a `sh`/`bash` block is a script, every line a command. A `console` block shows
a session: a line starting with `$ ` is a command (continued on the next lines while a line
ends in a backslash), every other line is output, shown for illustration and not compared.
"""

import dataclasses
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHELL = {"sh", "bash", "shell", "console"}
PYTHON = {"python", "py"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(not run|run):\s*(.*?)\s*-->\s*\Z", re.S)


@dataclasses.dataclass
class Block:
  doc: str      # "README.md" or "docs/x.md"
  number: int   # 1-based, among the doc's fenced blocks
  line: int     # the fence's line
  lang: str
  text: str
  marker: str | None = None  # "run", "not run" or None
  spec: str = ""

  @property
  def where(self) -> str:
    return f"{self.doc} block {self.number} (line {self.line}, ```{self.lang})"


def docs() -> list[str]:
  return ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def blocks(doc: str) -> list[Block]:
  text = (ROOT / doc).read_text()
  found = []
  for number, m in enumerate(FENCE.finditer(text), 1):
    before = text[:m.start()].rstrip()
    marker = MARKER.search(before.rsplit("\n", 1)[-1] if before else "")
    found.append(Block(doc, number, text.count("\n", 0, m.start()) + 1, m.group(1),
                       m.group(2), marker and marker.group(1), marker.group(2) if marker else ""))
  return found


def commands(block: Block) -> list[str]:
  """The block's shell commands, each a logical line (continuations joined)."""
  lines = block.text.splitlines()
  if block.lang == "console":
    out, cont = [], False
    for line in lines:
      if cont:
        out[-1] += "\n" + line
      elif line.startswith("$ "):
        out.append(line[2:])
      else:
        continue
      cont = line.endswith("\\")
    return out
  return [block.text]


def apply_spec(block: Block, cmds: list[str]) -> tuple[list[str], dict[str, str]]:
  """(the commands scaled down by the block's `run:` SPEC, the environment it sets)."""
  env: dict[str, str] = {}
  for clause in filter(None, (c.strip() for c in block.spec.split(";"))):
    if clause.startswith("first:"):
      cmds = [clause.removeprefix("first:").strip()] + cmds
      continue
    sub = re.fullmatch(r'"(.*)"\s*->\s*"(.*)"', clause, re.S)
    if sub:
      old, new = (s.encode().decode("unicode_escape") for s in sub.groups())
      assert any(old in c for c in cmds), f"{block.where}: run: {old!r} is not in the block"
      cmds = [c.replace(old, new) for c in cmds]
      continue
    words = shlex.split(clause)
    only = words.pop(0)[:-1] if words and words[0].endswith(":") else None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
      name, value = words.pop(0).split("=", 1)
      env[name] = value
    flags = _flags(words)
    cmds = [_scale_script(c, flags, only) for c in cmds]
  return cmds, env


def _flags(words: list[str]) -> list[tuple[str, str | None]]:
  flags = []
  for w in words:
    if w.startswith("--"):
      flags.append((w, None))
    else:
      assert flags and flags[-1][1] is None, f"run: value {w!r} follows no flag"
      flags[-1] = (flags[-1][0], w)
  return flags


CI_TRAIN = [("--sample-tokens", "0"), ("--set", "train.eval_batches=1")]


def with_ci_train(cmds: list[str]) -> list[str]:
  """The commands with `CI_TRAIN`'s flags added to each training command that lacks them."""
  return [_scale_script(c, CI_TRAIN, "train", keep=True) for c in cmds]


COMMAND = re.compile(r"(?:python\s+train\.py|\bshardlab\s+(?:data\s+)?([a-z-]+))")


def _scale_script(script: str, flags, only: str | None, keep: bool = False) -> str:
  # One command per logical line: join continuations, scale, keep the joined form.
  logical = script.replace("\\\n", " ")
  return "\n".join(_scale_line(line, flags, only, keep) for line in logical.split("\n"))


def _scale_line(line: str, flags, only: str | None, keep: bool = False) -> str:
  """`line` with `flags` replacing the command's own (or added); with `keep`, a flag the
  command already gives is left as it is."""
  m = COMMAND.search(line)
  if not m or (only and (m.group(1) or "train") != only):
    return line
  # Flags go before a comment, a redirection or a pipe, after the command's own words.
  cut = re.search(r"\s(#|>|\|)", line[m.end():])
  head, tail = (line[:m.end() + cut.start()], line[m.end() + cut.start():]) if cut else (line, "")
  for flag, value in flags:
    if flag == "--set":
      key = value.split("=", 1)[0]
      pat = re.compile(rf"--set\s+{re.escape(key)}=\S+")
      new = f"--set {value}"
    else:
      pat = re.compile(rf"{re.escape(flag)}(?:[ =](?!--)\S+)?" if value else
                       rf"{re.escape(flag)}(?=\s|$)")
      new = f"{flag} {shlex.quote(value)}" if value else flag
    if not pat.search(head):
      head = f"{head} {new}"
    elif not keep:
      head = pat.sub(lambda _: new, head, count=1)
  return head + tail
