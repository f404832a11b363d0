"""Every `shardlab` command's --help (and train.py's) is complete: the top level lists each
command with a line saying what it does, every parser has a description, every option and
positional has help text that shows its default, and every option a help text names exists
in the command it names (this one, or the `train.py ...` / `shardlab X ...` it quotes).

The parsers are found by running each command's entry point with its parse step replaced,
so a command, subcommand or option added later is checked without listing it here."""

import argparse
import re

import pytest

from _pytest.config.argparsing import Parser as PytestParser

from shardlab import cli
from shardlab.bounds import Bound
from shardlab.cli import plan as plan_cli
from shardlab.cli.train import train_parser


class _Parsed(Exception):

  def __init__(self, parser):
    super().__init__(parser.prog)
    self.parser = parser


def _parser_of(entry, argv, monkeypatch) -> argparse.ArgumentParser:
  """The parser `entry(argv)` parses its arguments with (nothing runs past that point)."""

  def stop(self, args=None, namespace=None):
    raise _Parsed(self)

  with monkeypatch.context() as m:
    m.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    with pytest.raises(_Parsed) as got:
      entry(argv)
  return got.value.parser


def _with_subparsers(key: str, parser) -> dict:
  out = {key: parser}
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        out.update(_with_subparsers(f"{key} {name}", sub))
  return out


def _nested(command: str) -> list[list[str]]:
  """The argv that reach a command's other parsers (dispatched before argparse runs)."""
  if command == "plan":
    overview = plan_cli.overview_parser()
    sub = next(a for a in overview._actions if isinstance(a, argparse._SubParsersAction))
    return [[name] for name in sub.choices]
  return [["--slurm"]] if command == "launch" else []


@pytest.fixture(scope="module")
def parsers() -> dict:
  """{how it is invoked: parser}, e.g. "shardlab plan serve", "train.py"."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    out = {"train.py": train_parser()}
    for command, entry in cli.COMMANDS.items():
      for argv in [[]] + _nested(command):
        key = " ".join(["shardlab", command, *argv])
        run = lambda a, entry=entry, key=key: entry(a, prog=key)
        out.update(_with_subparsers(key, _parser_of(run, argv, monkeypatch)))
    out["shardlab plan --help"] = plan_cli.overview_parser()
    return out


def _plugin_parser() -> argparse.ArgumentParser:
  """The argparse parser of the pytest plugin's options (and pytest's positional)."""
  from shardlab.testing import plugin
  parser = PytestParser(_ispytest=True)
  plugin.pytest_addoption(parser)
  return parser.optparser


def _actions(parser):
  return [a for a in parser._actions
          if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def test_top_level_help_lists_every_command_with_a_description(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  top = cli.top_parser()
  sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
  helps = {a.dest: a.help for a in sub._choices_actions}
  assert set(helps) == set(cli.COMMANDS)
  for name, text in helps.items():
    assert text and len(text) > 10, name
    first_words = " ".join(text.split()[:4])
    assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(first_words)}", out, re.M), name
  assert top.description


def test_no_command_is_an_error_that_shows_the_commands(capsys):
  assert cli.main([]) == 2
  assert "train" in capsys.readouterr().err
  assert cli.main(["trian"]) == 2
  assert "'trian'" in capsys.readouterr().err


def test_every_parser_was_found(parsers):
  for command in cli.COMMANDS:
    assert f"shardlab {command}" in parsers
  for nested in ("shardlab plan serve", "shardlab plan longest-context",
                 "shardlab launch --slurm", "shardlab convert to-hf", "shardlab data prepare"):
    assert nested in parsers


def test_every_parser_has_a_description(parsers):
  missing = [key for key, p in parsers.items() if not (p.description or "").strip()]
  assert not missing, missing


def test_every_option_and_positional_has_help(parsers):
  missing = []
  for key, p in parsers.items():
    for a in _actions(p):
      if isinstance(a, argparse._SubParsersAction):
        missing += [f"{key} {c.dest}" for c in a._choices_actions if not c.help]
      elif not (a.help or "").strip():
        missing.append(f"{key} {'/'.join(a.option_strings) or a.dest}")
  assert not missing, missing


def _shown(default, text: str) -> bool:
  forms = {str(default)} | ({f"{default:g}"} if isinstance(default, float) else set())
  return any(f in text for f in forms)


def test_every_default_is_shown(parsers):
  """A default that is not None / off / empty appears in the option's expanded help."""
  missing = []
  for key, p in parsers.items():
    formatter = p._get_formatter()
    for a in _actions(p):
      d = a.default
      if d is None or d is argparse.SUPPRESS or isinstance(d, bool) or d == [] or not a.help:
        continue
      text = formatter._expand_help(a)
      if not _shown(d, text):
        missing.append(f"{key} {'/'.join(a.option_strings) or a.dest}: {d!r} not in "
                       f"{text!r}")
  assert not missing, "\n".join(missing)


def test_every_number_is_bounded_and_help_shows_its_range(parsers):
  """Each option that takes a number parses it with a declared Bound (shardlab/bounds.py:
  a value out of range is argparse's exit 2), its expanded help shows the range, and its
  default lies in it. A new `type=int` or `type=float` option fails here."""
  wrong = []
  for key, p in {**parsers, "pytest (the shardlab plugin)": _plugin_parser()}.items():
    formatter = p._get_formatter()
    for a in _actions(p):
      name = f"{key} {'/'.join(a.option_strings) or a.dest}"
      number = isinstance(a.default, (int, float)) and not isinstance(a.default, bool)
      if not isinstance(a.type, Bound):
        if a.type in (int, float) or number:
          wrong.append(f"{name}: a number with no declared bound (type={a.type!r})")
        continue
      if str(a.type) not in formatter._expand_help(a):
        wrong.append(f"{name}: the help does not show the range {str(a.type)!r}")
      if a.default is not None and not a.type.holds(a.default):
        wrong.append(f"{name}: the default {a.default!r} is outside {a.type}")
  assert not wrong, "\n".join(wrong)


OPTION = re.compile(r"(?<![\w=-])--[a-z][a-z0-9-]*")


def _named_options(text: str, own: str, keys: list[str]) -> list[tuple[str, str]]:
  """(command, option) for each `--option` in `text`: of the command quoted before it in the
  same clause (`train.py --run-dir`, `shardlab data prepare ... --tokenizer`), else `own`."""
  found = []
  for clause in re.split(r"[\n;()`]|\.\s", text):
    marks = []  # (start, end, command) of each command quoted in the clause, longest first
    for k in sorted(keys, key=len, reverse=True):
      for m in re.finditer(rf"(?<![\w.-]){re.escape(k)}(?![\w.-])", clause):
        if not any(s <= m.start() < e for s, e, _ in marks):
          marks.append((m.start(), m.end(), k))
    for m in OPTION.finditer(clause):
      if any(s <= m.start() < e for s, e, _ in marks):
        continue  # part of a quoted command's name (`shardlab launch --slurm`)
      before = [(s, k) for s, e, k in marks if e <= m.start()]
      found.append((max(before)[1] if before else own, m.group()))
  return found


def test_every_option_named_in_help_exists(parsers):
  keys = [k for k in parsers if k != "shardlab plan --help"] + ["shardlab plan"]
  keys = sorted(set(keys) | {"python train.py"})
  alias = {"python train.py": "train.py"}
  wrong = []
  for key, p in parsers.items():
    texts = [(key, a.help or "") for a in _actions(p)]
    texts += [(key, p.description or ""), (key, p.epilog or "")]
    texts += [(f"{key.removesuffix(' --help')} {c.dest}", c.help or "")  # a subcommand's own
              for a in _actions(p) if isinstance(a, argparse._SubParsersAction)
              for c in a._choices_actions]
    for own, text in texts:
      for command, option in _named_options(text, own, keys):
        target = parsers[alias.get(command, command)]
        if option not in {s for a in target._actions for s in a.option_strings}:
          wrong.append(f"{key}: {option} (of {alias.get(command, command)}) in {text!r}")
  assert not wrong, "\n".join(wrong)


def test_inspect_help_names_only_its_own_options(capsys):
  """The issue's case: `inspect --help` named train.py's --auto-top."""
  with pytest.raises(SystemExit):
    cli.main(["inspect", "--help"])
  assert "--auto-top" not in capsys.readouterr().out
