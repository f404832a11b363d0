"""The TPU compiler's own estimate of a compiled step's compute time, in cycles.

XLA:TPU writes `"estimated_cycles":"N"` into the backend config of each instruction it
schedules (fusions, copies, custom calls); a fusion's inner instructions carry none, so no
cycle is counted twice. Summed with how many times each computation runs per step (scan
bodies times their trip counts, observe/hlo_text.py) this is the step's compute time on the
chip, without a chip: what `bench/plan_tpu.py` compares between layouts and trainers.
`compiled.cost_analysis()` is no substitute: it counts a loop's body once, and its
`optimal_seconds` comes out negative for these programs.

The cycles are the TensorCore's. Seconds need its clock, taken here from the published
peak (bf16 FLOP/s = clock × MXUs × 128 × 128 × 2 per core), e.g.
v5e 197 TFLOP/s over 4 MXUs of 128² → 1.5 GHz; v5p 459 over 2 cores × 4 MXUs → 1.75 GHz
(a megacore chip is one JAX device, its two cores one program).
Collectives overlap or not as the schedule says, which this estimate does not model.
"""

import re

from shardlab.observe import hlo_text

_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
# TensorCore clocks in GHz by topology prefix (runtime/hardware.py), from the published
# peaks as above (v4: 275 TFLOP/s over 2 cores × 4 MXUs → 1.05). v6e's is left out: its MXU
# count per core is not published beside its peak.
CLOCK_GHZ = {"v4": 1.05, "v5e": 1.5, "v5p": 1.75}


def estimated_cycles(text: str) -> int:
  """Cycles per step of a compiled TPU program's optimised HLO text; 0 for a program from
  another backend (XLA:CPU and XLA:GPU write no estimate)."""
  if "estimated_cycles" not in text:
    return 0
  return cycles_of(*hlo_text.with_runs(text))


def cycles_of(computations: dict, runs: dict) -> int:
  """`estimated_cycles` of a program already read (`hlo_text.with_runs`)."""
  total = 0
  for name, instrs in computations.items():
    for instr in instrs if runs.get(name) else ():
      m = _CYCLES.search(instr.attrs)
      if m:
        total += int(m.group(1)) * runs[name]
  return total


def seconds(cycles: int, chip: str) -> float | None:
  """`cycles` at `chip`'s TensorCore clock (chip: a topology prefix, "v5e"); None where
  the clock is not known here."""
  ghz = CLOCK_GHZ.get(chip)
  return cycles / (ghz * 1e9) if ghz else None
