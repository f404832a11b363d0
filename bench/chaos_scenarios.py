"""The chaos harness's scenarios (bench/chaos.py): what runs, how it is killed, how it resumes.

Every training scenario is test_multihost's small fp32 model for STEPS steps, saving every
step (so most moments of a run are inside a save), on 8 simulated CPU devices: one process,
or two under `shardlab launch` (tests/test_chaos.py takes fewer of both, to be quick). The
resume is the same command; `data prepare` is redone with --overwrite (an interrupted
prepare is refused, never continued).
"""

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_multihost import PY, SMALL, env  # noqa: E402,F401  (the suite's run settings)

STEPS = 6
TRAIN_MOMENTS = ("random", "mid-step", "mid-save", "mid-restore")
PREPARE_MOMENTS = ("random", "mid-prepare")
LAUNCH = [PY, "-m", "shardlab.cli", "launch", "-n", "2", "--devices-per-process"]


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  kind: str  # "train" or "prepare"
  mesh: str = ""
  strategy: str = ""
  sets: tuple[str, ...] = ()  # config overrides besides SMALL's
  launched: bool = False  # 2 processes under `shardlab launch`, half the devices each
  model: str = "tiny"
  devices: int = 8  # simulated CPU devices in all
  steps: int = STEPS
  moments: tuple[str, ...] = TRAIN_MOMENTS

  def argv(self, work: Path, resume: bool = False) -> list[str]:
    """The command, writing under `work`; `resume`: the command that redoes a killed one."""
    if self.kind == "prepare":
      return [PY, "-m", "shardlab.cli", "data", "prepare", "stdlib", str(work / "out"),
              "--max-bytes", "3000000", "--workers", "1", "--shard-tokens", "200000",
              *(["--overwrite"] if resume else [])]
    sets = [a for s in (*SMALL, f"train.steps={self.steps}", "checkpoint.every=1", *self.sets)
            for a in ("--set", s)]
    cmd = [PY, str(ROOT / "train.py"), "--model", self.model, "--mesh", self.mesh,
           "--strategy", self.strategy, *sets, "--checkpoint-dir", str(work / "ckpt"),
           "--metrics-file", str(work / "metrics.jsonl"), "--logger", "none",
           "--sample-tokens", "0"]
    if self.launched:
      return [*LAUNCH, str(self.devices // 2), "--", *cmd]
    return cmd + ["--simulate-devices", str(self.devices)]


SCENARIOS = {s.name: s for s in [
    Scenario("dp", "train", "data:8", "dp"),
    Scenario("fsdp", "train", "fsdp:8", "fsdp"),
    Scenario("tp", "train", "data:4,tensor:2", "tp"),
    Scenario("pipeline", "train", "stage:2,fsdp:4", "fsdp", ("train.microbatches=4",)),
    Scenario("expert", "train", "expert:4,fsdp:2", "fsdp", model="moe-tiny"),
    Scenario("launch", "train", "dcn.data:2,fsdp:4", "fsdp", launched=True),
    Scenario("prepare", "prepare", moments=PREPARE_MOMENTS),
]}
