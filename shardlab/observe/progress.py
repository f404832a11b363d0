"""The console: a live progress bar for training and live timers for long work (compiling),
drawn by rich on a terminal; plain lines, one per logged step, anywhere else (logs)."""

import sys

from rich.console import Console
from rich.progress import BarColumn, Progress as RichProgress, TaskProgressColumn, TextColumn
from rich.progress import TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column


def duration(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# The step line's fields, in display order, with the order a narrow line drops them in
# (higher first); 0: never dropped — the step, tokens/s, MFU and ETA are what the bar is for.
DROP_ORDER = {"step": 0, "loss": 1, "lr": 5, "grad_norm": 3, "tok/s": 0, "ms/step": 2,
              "TFLOP/s": 4, "MFU": 0, "ETA": 0}


def bar_width(columns: int) -> int:
  """The bar's columns: narrower on a narrow terminal, so the loss keeps its place at 80."""
  return 20 if columns >= 120 else 8


def step_fields(record: dict, total: int) -> dict[str, str]:
  """step, loss, lr, grad norm, throughput, MFU and ETA of one logged step, as text."""
  eta = record["step_time_s"] * (total - record["step"])
  fields = {"step": f"step {record['step']:>{len(str(total))}}/{total}", "loss": f"loss {record['loss']:.4f}",
            "lr": f"lr {record['lr']:.2e}" if "lr" in record else "",  # sl.fit: a schedule's
            "grad_norm": f"grad_norm {record['grad_norm']:.3f}",
            "tok/s": f"{record['tokens_per_s']:,.0f} tok/s",
            "ms/step": f"{record['step_time_s'] * 1e3:.0f} ms/step"}
  fields = {k: v for k, v in fields.items() if v}
  if "tflops_per_device" in record:
    fields["TFLOP/s"] = f"{record['tflops_per_device']:.3g} TFLOP/s/dev"
  if "mfu" in record:
    fields["MFU"] = f"MFU {record['mfu']:.1%}"
  fields["ETA"] = f"ETA {duration(eta)}"
  return fields


def step_line(record: dict, total: int, width: int | None = None) -> str:
  """The fields on one line; within `width` columns, dropping fields by DROP_ORDER."""
  fields = step_fields(record, total)
  line = lambda: "  ".join(fields.values())
  for name in sorted(fields, key=lambda n: -DROP_ORDER[n]):
    if width is None or len(line()) <= width or not DROP_ORDER[name]:
      break
    del fields[name]
  return line()


def _console(stream) -> Console:
  return Console(file=stream, force_terminal=stream.isatty(), highlight=False,
                 soft_wrap=True)


class Progress:
  """The training bar. `quiet` drops the per-step lines but keeps messages; `silent`
  (processes other than 0 in a multi-process run) drops everything. `close` ends the bar."""

  def __init__(self, total_steps: int, quiet: bool = False, silent: bool = False,
               stream=None):
    self.total, self.stream = total_steps, stream or sys.stdout
    self.quiet, self.silent = quiet or silent, silent
    self.console = _console(self.stream)
    self.live = self.stream.isatty() and not self.quiet
    self._bar = None

  def update(self, record: dict) -> None:
    if self.quiet:
      return
    if not self.live:
      self.stream.write(step_line(record, self.total) + "\n")
      self.stream.flush()
      return
    # What the bar and its percentage leave of the terminal's width.
    bar = bar_width(self.console.width)
    line = step_line(record, self.total, self.console.width - bar - 6)
    if self._bar is None:
      # The metrics take what the bar and percentage leave, cut short on a narrow terminal.
      metrics = TextColumn("{task.description}",
                           table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1))
      self._bar = RichProgress(BarColumn(bar_width=bar), TaskProgressColumn(), metrics,
                               console=self.console, auto_refresh=False, expand=True)
      self._task = self._bar.add_task("", total=self.total)
      self._bar.start()
    self._bar.update(self._task, completed=record["step"], description=line)
    self._bar.refresh()

  def message(self, text: str) -> None:
    """A line of its own, printed above the live bar."""
    if self.silent:
      return
    (self._bar.console if self._bar else self.console).print(text, markup=False)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()
      self._bar = None


class Activity:
  """A live line for long work on a terminal: elapsed time, and a bar with ETA once
  `advance` is given a total; prints nothing elsewhere (logs get the caller's message).

      with Activity("compiling the train step", progress):
        compiled = step.lower(...).compile()
  """

  def __init__(self, label: str, progress: "Progress | None" = None, total: int | None = None,
               stream=None):
    self.label, self.total = label, total
    self.stream = stream or (progress.stream if progress else sys.stdout)
    self.live = self.stream.isatty() and not (progress and progress.quiet)
    self._bar = None

  def advance(self, n: int = 1) -> None:
    if self._bar is not None:
      self._bar.advance(self._task, n)

  def __enter__(self) -> "Activity":
    if self.live:
      columns = [TextColumn(self.label), TimeElapsedColumn()]
      if self.total:
        columns = [BarColumn(), TextColumn(f"{self.label} {{task.completed}}/{self.total}"),
                   TextColumn("ETA"), TimeRemainingColumn()]
      self._bar = RichProgress(*columns, console=_console(self.stream), transient=True,
                               refresh_per_second=4)
      self._task = self._bar.add_task(self.label, total=self.total)
      self._bar.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._bar is not None:
      self._bar.stop()
