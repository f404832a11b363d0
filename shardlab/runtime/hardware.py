"""Accelerators the planner can target: peak compute, memory, and link bandwidths per device.

Conventions (so every entry means the same thing):
  peak_flops  dense bf16 FLOP/s per device (no structured sparsity);
  hbm_bytes   HBM capacity per device; `usable_bytes` is what a program can hold after the
              runtime's reservations (see `usable_bytes`);
  hbm_bw      HBM bandwidth, bytes/s;
  ici_bw      fast-domain bandwidth per device, one direction (bytes/s): NVLink inside a GPU
              node, ICI inside a TPU slice. Google publishes *bidirectional* ICI per chip, so
              TPU entries are half of that figure;
  dcn_bw      bandwidth per device across nodes/slices, one direction (bytes/s): the node's
              NICs (InfiniBand for GPUs, the host's data-centre network for TPUs) divided by
              its devices;
  host_bw     device ↔ host memory per device, one direction (bytes/s): PCIe;
  ici_domain  how many devices share the fast domain: a GPU node (8), a TPU slice's largest
              single-slice size. Mesh axes beyond it must cross DCN;
  efficiency  the fraction of peak_flops a well-tuned large training run achieves on the FLOPs
              it executes, recomputed ones included (its HFU: a published HFU, or a published
              MFU times the run's hardware over model FLOPs under its remat policy, as the
              planner counts them; `efficiency_source` says whose). A roofline at
              100% of peak is a ceiling no real step reaches. The planner's step model
              (shardlab/plan/training/step_time.py) runs the weight matmuls at
              step_time.MATMUL_OVER_STEP × this (a step's large matmuls run faster than its
              average, which carries attention, memory-bound ops and exposed collectives),
              and those other parts on their own terms; it reports the ceiling beside it.
"""

import dataclasses
import math

from shardlab.errors import ConfigError, read_toml, unknown
from shardlab.runtime.units import GB, GiB, MiB


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  peak_flops: float
  hbm_bytes: float
  hbm_bw: float
  ici_bw: float
  dcn_bw: float
  ici_domain: int
  reserve_bytes: float  # held back by the runtime/compiler, never available to a program
  kind: str  # "gpu" | "tpu"
  topology: str | None = None  # jax.experimental.topologies name prefix ("v5e"), TPUs only
  efficiency: float = 0.5  # achievable fraction of peak_flops (see the module docstring)
  efficiency_source: str = "assumption"
  # Host memory link per device, one direction (bytes/s): what offloaded state and
  # activations cross each step. PCIe 4.0 x16 (32 GB/s) unless an entry says otherwise;
  # TPU hosts publish no per-chip figure, so theirs is that assumption.
  host_bw: float = 32 * 10**9

  @property
  def usable_bytes(self) -> float:
    return self.hbm_bytes - self.reserve_bytes


_MEGATRON = ("Narayanan et al. 2021 (Megatron-LM): 163 of 312 TFLOP/s per A100, 1T GPT on "
             "3,072 GPUs")
_LLAMA3 = "Llama 3 paper (Dubey et al. 2024): 38-43% MFU, 405B on 8-16K H100s"

ACCELERATORS = {a.name: a for a in (
    # NVIDIA A100 datasheet (SXM4): 312 TFLOP/s bf16 dense; 1,555 GB/s (40GB) and 2,039 GB/s
    # (80GB) HBM; NVLink 3 600 GB/s total = 300 GB/s each way. DGX A100: one 200 Gb/s HDR
    # InfiniBand NIC per GPU = 25 GB/s. Capacity as nvidia-smi reports it (40960 / 81920 MiB).
    # Reserve: CUDA context and cuBLAS/cuDNN workspaces (~1 GiB; XLA also preallocates only
    # 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION is raised — set it to 0.95).
    # Efficiency: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    # Clusters Using Megatron-LM" (SC21): 163 TFLOP/s per GPU = 52% of peak, counting the
    # recomputed forward (hardware FLOPs, as the planner's compute time does). A best case
    # (1T parameters, large matmuls); the 40 GB part has the same tensor cores.
    Accelerator("a100-40g", 312e12, 40 * GiB, 1555 * GB, 300 * GB, 25 * GB, 8, 1 * GiB, "gpu",
                efficiency=0.52, efficiency_source=_MEGATRON),
    Accelerator("a100-80g", 312e12, 80 * GiB, 2039 * GB, 300 * GB, 25 * GB, 8, 1 * GiB, "gpu",
                efficiency=0.52, efficiency_source=_MEGATRON),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s
    # total = 450 GB/s each way; DGX H100: one 400 Gb/s NDR NIC per GPU = 50 GB/s.
    # nvidia-smi: 81559 MiB. Efficiency: "The Llama 3 Herd of Models" (Dubey et al. 2024),
    # Table 4: 38-43% BF16 MFU for Llama 3 405B on 8,192-16,384 H100s (430 and 400 TFLOP/s
    # per GPU); 0.40 sits in that range. H100s reach a smaller fraction of their (3× higher)
    # peak than A100s: memory, network and non-matmul work did not speed up as much.
    # Host link: PCIe 5.0 x16, 64 GB/s each way (H100 and H200 SXM).
    Accelerator("h100-80g", 989e12, 81559 * MiB, 3350 * GB, 450 * GB, 50 * GB, 8, 1 * GiB,
                "gpu", efficiency=0.40, efficiency_source=_LLAMA3, host_bw=64 * GB),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md, "Performance" set-up): 96 GB
    # HBM2e at 2.4 TB/s (95 GiB in an earlier version of the doc), run at its default 500 W
    # power limit (the SXM part's TDP is 700 W). Its peak
    # is published only as bounds: "between SXM and NVL, and we don't know its exact value"
    # (performance.md, footnote 2), i.e. between H100 NVL's 835 and SXM's 989 TFLOP/s bf16
    # dense; the midpoint, 912, is off by at most 8.5% whichever bound is the truth.
    # Efficiency, links and host as for the SXM part (same tensor cores, NVLink 4, 400 Gb/s
    # RDMA per GPU).
    Accelerator("h100-96g-500w", 912e12, 95 * GiB, 2400 * GB, 450 * GB, 50 * GB, 8, 1 * GiB,
                "gpu", efficiency=0.40, efficiency_source=_LLAMA3, host_bw=64 * GB),
    # NVIDIA H200 SXM datasheet: same compute and NVLink as H100, 141 GB HBM3e at 4.8 TB/s.
    # nvidia-smi: 143771 MiB. Efficiency: no published training MFU found; H100's figure is
    # assumed (same tensor cores and clocks; more bandwidth speeds memory-bound work only).
    # One H200 here trained the 1B Llama at 50-55% MFU and GPT-2 1.5B at 37% (no
    # collectives; docs/planning.md, "Against one real GPU"): not used, being one GPU.
    Accelerator("h200", 989e12, 143771 * MiB, 4800 * GB, 450 * GB, 50 * GB, 8, 1 * GiB, "gpu",
                efficiency=0.40, efficiency_source="assumption: the H100 figure (Llama 3 "
                "paper, 38-43% MFU); same tensor cores", host_bw=64 * GB),
    # NVIDIA L4 datasheet: 242 TFLOP/s bf16 with sparsity = 121 dense, 24 GB GDDR6 at
    # 300 GB/s, PCIe 4.0 x16 and no NVLink: devices talk over PCIe (32 GB/s each way).
    # nvidia-smi: 23034 MiB. Up to 8 per node (GCP g2-standard-96, 100 Gb/s per node =
    # 1.56 GB/s per GPU). Efficiency: no published training MFU; the H100 figure is assumed.
    Accelerator("l4-24g", 121e12, 23034 * MiB, 300 * GB, 32 * GB, 1.5625 * GB, 8, 1 * GiB,
                "gpu", efficiency=0.40,
                efficiency_source="assumption: the H100 figure (Llama 3 paper, 38-43% MFU)"),
    # Cloud TPU v4 docs: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, 2,400 Gbps ICI
    # (300 GB/s bidirectional), 4,096-chip pods, 4 chips per host. DCN per chip is not
    # published; 50 Gbps (6.25 GB/s) as for v5p is assumed. Efficiency: PaLM (Chowdhery et
    # al. 2022, Table 3): 46.2% MFU, 57.8% HFU for PaLM 540B on 6,144 v4 chips. HFU counts
    # the rematerialised FLOPs, as the planner's compute time does, so it is the one used.
    Accelerator("tpu-v4", 275e12, 32 * GiB, 1200 * GB, 150 * GB, 6.25 * GB, 4096, 0.25 * GiB,
                "tpu", "v4", efficiency=0.578,
                efficiency_source="PaLM (Chowdhery et al. 2022): 57.8% HFU (46.2% MFU), "
                "540B on 6,144 chips"),
    # Cloud TPU v5e docs: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, 400 GB/s bidirectional
    # ICI, 256-chip pods, 8 chips and 2 x 100 Gbps NICs per host (25 Gbps = 3.125 GB/s per
    # chip). The TPU compiler allows 15.75 GiB of the 16 GiB. Efficiency: MaxText's v5e
    # configs (MaxText/configs/v5e/README.md): 56-67% MFU for 16B-128B models on one
    # v5e-256 (59.9% at 64B), 46-64% on 32 of them; under full remat (its 16B-64B configs)
    # the forward runs again but for the MLP's down projection (whose output no backward
    # reads): the 64B model (global_parameter_scale=64: d 8192, 64 layers, MLP 28672, 2048
    # tokens) runs 1.254× its model FLOPs as the planner counts them
    # (plan/training/recompute.py), 75% HFU.
    Accelerator("tpu-v5e", 197e12, 16 * GiB, 819 * GB, 200 * GB, 3.125 * GB, 256, 0.25 * GiB,
                "tpu", "v5e", efficiency=0.75,
                efficiency_source="MaxText v5e configs: 59.9% MFU at 64B on a v5e-256 under "
                "full remat = 75% HFU"),
    # Cloud TPU v5p docs: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, 1,200 GB/s
    # bidirectional ICI, DCN 50 Gbps per chip, single slices up to 6,144 chips. Efficiency:
    # MaxText's model tiering (docs/reference/models/tiering.md): Llama 2 70B, 65.4% MFU on
    # 512 chips (its v5p configs README: 64-71% for 32B-1.16T models), under
    # save_dot_except_mlpwi, which recomputes the MLP's input projections and attention's
    # einsums: 1.193× the model FLOPs as the planner counts them, 78% HFU.
    Accelerator("tpu-v5p", 459e12, 95 * GiB, 2765 * GB, 600 * GB, 6.25 * GB, 6144, 0.25 * GiB,
                "tpu", "v5p", efficiency=0.78,
                efficiency_source="MaxText tiering: Llama 2 70B, 65.4% MFU on 512 chips under "
                "save_dot_except_mlpwi = 78% HFU"),
    # Cloud TPU v6e (Trillium) docs: 918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s, 800 GB/s
    # bidirectional ICI, 256-chip pods, 8 chips per host; 4 x 200 Gbps NICs per host
    # (100 Gbps = 12.5 GB/s per chip). Efficiency: MaxText's model tiering: Llama 2 70B,
    # 43.8% MFU on 256 chips (Llama 3.1 8B 45.5%, 70B 50.3%), under full remat: 1.248× the
    # model FLOPs as the planner counts them, 55% HFU.
    Accelerator("tpu-v6e", 918e12, 32 * GiB, 1638 * GB, 400 * GB, 12.5 * GB, 256, 0.25 * GiB,
                "tpu", "v6e", efficiency=0.55,
                efficiency_source="MaxText tiering: Llama 2 70B, 43.8% MFU on 256 chips under "
                "full remat = 55% HFU"),
)}


def get(name: str) -> Accelerator:
  """A listed accelerator by name, or one described in a TOML file (`from_file`)."""
  if name.endswith(".toml"):
    return from_file(name)
  if name not in ACCELERATORS:
    raise unknown("target accelerator", name, ACCELERATORS)
  return ACCELERATORS[name]


# Each field a target file may set: (type, lowest, highest, what it is). Bounds are
# inclusive; None: unbounded. The planner divides by the rates and the efficiency, so none
# may be zero, and no number may be NaN or inf.
_BYTES, _RATE = (float, 1, None, "bytes"), (float, 1, None, "bytes/s")
FILE_FIELDS = {
    "name": (str, None, None, "a label"), "peak_flops": (float, 1, None, "FLOP/s"),
    "hbm_bytes": _BYTES, "hbm_bw": _RATE, "ici_bw": _RATE, "dcn_bw": _RATE,
    "host_bw": _RATE, "ici_domain": (int, 1, None, "devices"),
    "reserve_bytes": (float, 0, None, "bytes"), "kind": (str, None, None, "gpu or tpu"),
    "topology": (str, None, None, "a TPU topology name"),
    "efficiency": (float, 1e-6, 1.0, "a fraction of peak_flops"),
    "efficiency_source": (str, None, None, "a citation")}
_KINDS = ("gpu", "tpu")


def _checked(path: str, field: str, value):
  """`value` of a target file's `field` as its declared type, or a ConfigError naming the
  file, the field, the value and what is valid."""
  kind, low, high, what = FILE_FIELDS[field]
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind is str:
    valid = _KINDS if field == "kind" else None
    if isinstance(value, str) and (valid is None or value in valid):
      return value
    if field == "topology" and value is None:
      return None
    expected = f"one of {', '.join(valid)}" if valid else "a string"
  else:
    # An int field takes only integers; a float field any finite number (10**400 is not).
    ok = number and (isinstance(value, int) if kind is int else
                     math.isfinite(value) if isinstance(value, float) else abs(value) < 1e300)
    if ok and (low is None or value >= low) and (high is None or value <= high):
      return value  # as written: an int stays an int, as in the table above
    expected = (f"{'an integer' if kind is int else 'a finite number'}"
                f"{f' >= {low:g}' if low is not None else ''}"
                f"{f' and <= {high:g}' if high is not None else ''} ({what})")
  raise ConfigError(f"target file {path!r}: {field} = {value!r} is not valid; valid: "
                    f"{expected}")


def from_file(path: str) -> Accelerator:
  """An accelerator from TOML: `base = "a100-80g"` and the fields that differ (a part with
  less memory, a slower network), or every field. Sizes in bytes, bandwidths in bytes/s."""
  fields = read_toml(path, f"target file {path!r}")
  extra = set(fields) - set(FILE_FIELDS) - {"base"}
  if extra:
    raise ConfigError(f"target file {path!r}: unknown field(s) {', '.join(sorted(extra))}; "
                      f"valid: base, {', '.join(sorted(FILE_FIELDS))}")
  base = fields.pop("base", None)
  if base is not None and (not isinstance(base, str) or base not in ACCELERATORS):
    raise ConfigError(f"target file {path!r}: base: "
                      f"{unknown('target accelerator', base, ACCELERATORS)}")
  base = dataclasses.asdict(ACCELERATORS[base]) if base is not None else {}
  fields = {k: _checked(path, k, v) for k, v in fields.items()}
  merged = {**base, "name": path, **fields}
  missing = sorted(f.name for f in dataclasses.fields(Accelerator)
                   if f.default is dataclasses.MISSING and f.name not in merged)
  if missing:
    raise ConfigError(f"target file {path!r} lacks {', '.join(missing)} (or give "
                      f"base = one of {', '.join(ACCELERATORS)})")
  acc = Accelerator(**merged)
  if acc.usable_bytes <= 0:
    raise ConfigError(f"target file {path!r}: reserve_bytes {acc.reserve_bytes} leaves "
                      f"nothing of hbm_bytes {acc.hbm_bytes}")
  return acc


def names() -> list[str]:
  return list(ACCELERATORS)
