"""The end-of-run PNG: loss and throughput against step, read back from the run's JSONL (so a
resumed run's plot covers every segment)."""

import json
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
  records = []
  for line in Path(path).read_text().splitlines():
    line = line.strip()
    if line:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # a line cut short by a kill: skip it
  return records


def write(metrics_jsonl: str | Path, png: str | Path, title: str = "",
          unit: str = "token") -> bool:
  """Plots loss (nats per `unit`, the data's: "byte" for the byte corpus) and tokens/s (with
  an MFU scale when recorded) by step; False if there is nothing to plot."""
  fig = figure(read_jsonl(metrics_jsonl), title, unit)
  if fig is None:
    return False
  import matplotlib.pyplot as plt
  Path(png).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=100)
  plt.close(fig)
  return True


def figure(lines: list[dict], title: str = "", unit: str = "token"):
  """The figure `write` saves, from the JSONL's records; None without a step to plot."""
  records = [r for r in lines if "step" in r and "loss" in r]
  if not records:
    return None
  import matplotlib
  matplotlib.use("Agg")  # files only, never a window
  import matplotlib.pyplot as plt

  by_step = {r["step"]: r for r in records}  # a resumed run may log a step twice: keep the last
  steps = sorted(by_step)
  fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  # A short run logs a few steps: markers keep one or two points visible (a line of one
  # point draws nothing).
  marker = "o" if len(steps) < 20 else None
  loss_ax.plot(steps, [by_step[s]["loss"] for s in steps], color="tab:blue", label="train",
               marker=marker)
  evals = {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}
  if evals:  # train.eval_every's and the final held-out loss
    loss_ax.plot(sorted(evals), [evals[s] for s in sorted(evals)], "o-", color="tab:orange",
                 label="held-out")
    loss_ax.legend()
  loss_ax.set_ylabel(f"loss (nats/{unit})")
  loss_ax.grid(alpha=0.3)
  speed_ax.plot(steps, [by_step[s].get("tokens_per_s", float("nan")) for s in steps],
                color="tab:green", marker=marker)
  speed_ax.set_ylabel("tokens/s")
  speed_ax.set_xlabel("step")
  speed_ax.grid(alpha=0.3)
  last = by_step[steps[-1]]
  if last.get("mfu") and last.get("tokens_per_s"):
    # MFU is proportional to tokens/s for a run's config: a second scale, not a second line.
    k = 100 * last["mfu"] / last["tokens_per_s"]
    mfu_ax = speed_ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k))
    mfu_ax.set_ylabel("MFU (%)")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig
