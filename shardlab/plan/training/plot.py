"""`shardlab plan --plot FILE.png`: each strategy's per-device memory on the request's device
count (stacked bars against the target's usable memory) and, with --search, the candidates'
predicted step time against their memory."""

import textwrap
from pathlib import Path

from shardlab.plan.training.estimate import default_shape
from shardlab.runtime.units import GiB

# (label, colour) per stacked part, bottom to top: the state first, then what a step adds.
PARTS = (("params", "#4C72B0"), ("gradients", "#DD8452"), ("master weights", "#55A868"),
         ("optimizer state", "#C44E52"), ("activations", "#8172B3"),
         ("temporaries (gathered weights, batch)", "#CCB974"))
OFF_SCALE = 2.5  # bars taller than this many times the usable memory are cut, their total noted


def _parts(memory) -> list[float]:
  return [memory.params, memory.grads, memory.master, memory.opt_state, memory.activations,
          memory.gathered + memory.batch]


def _short_mesh(shape: dict) -> str:
  return " ".join(f"{a}={s}" for a, s in shape.items() if s > 1) or "1 device"


def label(e) -> str:
  """What the plot says of one strategy: "fits", "does not fit", or why it cannot run."""
  if isinstance(e, str):
    return f"cannot run: {e}"
  return "fits" if e.fits else "does not fit"


def write(result, path: str | Path) -> dict[str, str]:
  """Draws the PNG (Agg: files only); returns each strategy's label as drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  searched = result.search is not None
  fig, axes = plt.subplots(1, 2 if searched else 1, figsize=(15 if searched else 9, 6.5),
                           squeeze=False, width_ratios=[1.1, 1] if searched else None)
  labels = _memory_panel(axes[0][0], result)
  if searched:
    _search_panel(axes[0][1], result)
  r = result.request.train
  fig.suptitle(f"{result.model.name} on {result.estimate.n_devices} × {result.target.name}: "
               f"{r.global_batch} × {r.seq_len} tokens, {r.microbatches} microbatch(es), "
               f"{r.precision}, remat {r.remat}, {r.optimizer}")
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return labels


def _memory_panel(ax, result) -> dict[str, str]:
  usable = result.target.usable_bytes / GiB
  totals = [e.memory.total / GiB for e in result.strategies.values() if not isinstance(e, str)]
  top = max(usable * 1.3, min(max(totals, default=0), OFF_SCALE * usable) * 1.12)
  labels, names = {}, list(result.strategies)
  for x, (strategy, e) in enumerate(result.strategies.items()):
    labels[strategy] = label(e)
    if isinstance(e, str):
      reason = textwrap.fill(e.split(";")[0], 64)
      ax.text(x, top * 0.03, f"cannot run here: {reason}", rotation=90, ha="center",
              va="bottom", fontsize=7.5, color="dimgray",
              bbox=dict(facecolor="white", edgecolor="lightgray", pad=2))
      continue
    bottom = 0.0
    for (part, colour), value in zip(PARTS, _parts(e.memory)):
      ax.bar(x, value / GiB, 0.7, bottom=bottom, color=colour, label=part if x == 0 else None)
      bottom += value / GiB
    total = e.memory.total / GiB
    note = f"{total:,.1f} GiB" + (" ↑" if total > top else "")
    ax.text(x, min(total + top * 0.01, top * 0.9), f"{note}\n{labels[strategy]}",
            ha="center", va="bottom", fontsize=8, color="black" if e.fits else "firebrick",
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1.5))
  ax.axhline(usable, color="black", linestyle="--", linewidth=1, zorder=0,
             label=f"{result.target.name}: {usable:.1f} GiB usable")
  n = result.estimate.n_devices
  ax.set_xticks(range(len(names)))
  ax.set_xticklabels([f"{s}\n{_short_mesh(default_shape(s, n, result.model, result.target))}"
                      for s in names], fontsize=8)
  ax.set_ylim(0, top)
  ax.set_ylabel("memory per device (GiB)")
  ax.set_title("per-device memory by strategy (each on its usual mesh)", fontsize=10)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3,
            frameon=False)
  ax.grid(axis="y", alpha=0.3)
  return labels


def _search_panel(ax, result) -> None:
  import matplotlib.pyplot as plt

  found, usable = result.search, result.target.usable_bytes / GiB
  styles = zip(result.strategies, plt.get_cmap("Dark2").colors, "osD^vP")
  for strategy, colour, marker in styles:
    rows = [e for e in found if e.strategy == strategy]
    if rows:
      ax.scatter([e.memory.total / GiB for e in rows], [e.step_s for e in rows], s=40,
                 color=colour, marker=marker, label=f"{strategy} ({len(rows)})", alpha=0.85)
  if found:
    best = found[0]
    ax.scatter([best.memory.total / GiB], [best.step_s], s=220, marker="*", color="gold",
               edgecolor="black", zorder=3, label="fastest")
    ax.annotate(f"{best.strategy} {_short_mesh(best.mesh_shape)}\n{best.step_s:.2f} s, "
                f"MFU {best.mfu:.0%} (ceiling {best.mfu_ceiling:.0%})",
                (best.memory.total / GiB, best.step_s), textcoords="offset points",
                xytext=(-10, 14), ha="right", fontsize=8)
  else:
    ax.text(0.5, 0.5, "nothing fits on this device count", transform=ax.transAxes,
            ha="center")
  ax.axvline(usable, color="black", linestyle="--", linewidth=1)
  ax.set_xlim(0, usable * 1.05)
  ax.set_xlabel("memory per device (GiB)")
  ax.set_ylabel("predicted step time (s)")
  ax.set_title(f"search: {len(found)} fitting meshes on {result.estimate.n_devices} devices",
               fontsize=10)
  ax.legend(fontsize=8, loc="best")
  ax.grid(alpha=0.3)
