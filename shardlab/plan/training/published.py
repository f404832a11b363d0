"""Published measured training runs the step-time model is checked against
(bench/plan_published.py, tests/test_plan_published.py): each as its source published it
(model, devices, parallelism, batch, sequence, remat) with the measured tokens/s per device.

Split, fixed before any prediction was compared: runs whose figure is a `hardware.py`
efficiency source are fitted (they were used already); the rest, in the order listed,
alternate fitted, held-out, fitted, ... The model's constants may be tuned on the fitted
half only; the held-out half is the test.

Megatron's figure is achieved TFLOP/s per GPU counting the recomputed forward; it is turned
into tokens/s with the paper's own count, 96·l·h²·(1 + s/6h + V/16lh) FLOPs per sequence
token ÷ B·s (its equation 3 per token).
"""

import dataclasses

from shardlab import remat as remat_lib

MEGATRON = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
            "Clusters Using Megatron-LM, Table 1 (https://arxiv.org/abs/2104.04473)")
TORCHTITAN_A100 = ("torchtitan docs/performance.md, Llama 3 / Llama 2 on 64 A100 80GB, FSDP2 "
                   "(https://github.com/pytorch/torchtitan/blob/main/docs/performance.md)")
TORCHTITAN_H100 = ("torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100, FSDP, "
                   "selective AC; 96 GB HBM2e H100s at a 500 W power limit, peak between "
                   "NVL and SXM (its footnote 2) (https://github.com/pytorch/torchtitan/"
                   "blob/main/docs/performance.md)")
MAXTEXT_V6E = ("MaxText docs/reference/models/tiering.md (v6e Gold: Llama 2 70B, 256 chips, "
               "SL=4096, ~900 tokens/s/device); settings: benchmarks/"
               "maxtext_trillium_model_configs.py llama2_70b_4096 (per_device_batch_size 4, "
               "fsdp 256, remat full, flash) (https://github.com/AI-Hypercomputer/maxtext)")

MAXTEXT_V6E_LLAMA31 = (
    "MaxText docs/reference/models/tiering.md (v6e Gold: Llama 3.1 8B, 256 chips, SL=8192, "
    "7,207 tokens/s/device; Llama 3.1 70B, 256 chips, SL=8192, 960); settings: benchmarks/"
    "maxtext_trillium_model_configs.py llama3_1_8b_8192 (per_device_batch_size 4) and "
    "llama3_1_70b_8192 (5): fsdp 256, remat custom (decoder input and q/k/v projections "
    "offloaded, and out_proj for 8B), flash (https://github.com/AI-Hypercomputer/maxtext)")
MAXTEXT_V5P = ("MaxText docs/reference/models/tiering.md (v5p Gold: Llama 2 70B, 512 chips, "
               "SL=4096, 692 tokens/s/device); settings: benchmarks/maxtext_v5p_model_configs"
               ".py llama2_70b_v5p_128 (per_device_batch_size 4, fsdp, remat "
               "save_dot_except_mlpwi) (https://github.com/AI-Hypercomputer/maxtext)")


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  model: object  # a preset name or a model config
  target: str
  strategy: str
  mesh: dict  # axis -> size
  global_batch: int
  seq_len: int
  remat: str
  tokens_per_s: float  # measured, per device
  source: str
  microbatches: int = 1
  fitted: bool | None = None  # None: by the alternation rule; True: a hardware.py source


def _gpt(name: str, heads: int, d: int, layers: int):
  from shardlab.models.gpt2_config import GPT2Config
  return GPT2Config(name=name, vocab_size=51200, d_model=d, n_layers=layers, n_heads=heads,
                    max_seq_len=2048, attention="xla")  # 2021: no flash attention


def _megatron(name, heads, d, layers, tp, pp, gpus, batch, tflops) -> Run:
  s, v = 2048, 51200
  per_token = 96 * layers * d * d * (1 + s / (6 * d) + v / (16 * layers * d))
  mesh = {"data": gpus // (tp * pp), "tensor": tp}
  if pp > 1:
    mesh["stage"] = pp
  return Run(f"megatron-{name}", _gpt(f"gpt-{name}", heads, d, layers), "a100-80g", "tp",
             mesh, batch, s, "full", tflops * 1e12 / per_token, MEGATRON,
             microbatches=batch // (gpus // (tp * pp)) if pp > 1 else 1)


def _titan(model, target, gpus, local_batch, seq, remat, tps, source, fitted=None) -> Run:
  return Run(f"torchtitan-{model}-{target}-b{local_batch}-{remat}", model, target, "fsdp",
             {"fsdp": gpus}, gpus * local_batch, seq, remat, tps, source, fitted=fitted)


# Listed in each source's own order (its table's rows), sources in this order.
RUNS = (
    _megatron("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    # Table 1's pipelined rows (39.1B on) are left out: Megatron reduces the gradients once a
    # step, shardlab's pipeline (which the planner models) once an iteration.
    _titan("llama3-8b", "a100-80g", 64, 1, 8192, "save-matmul-outputs", 2973, TORCHTITAN_A100),
    _titan("llama3-70b", "a100-80g", 64, 1, 8192, "full", 331, TORCHTITAN_A100),
    _titan("llama2-13b", "a100-80g", 64, 2, 4096, "none", 2162, TORCHTITAN_A100),
    _titan("llama2-13b", "a100-80g", 64, 2, 4096, "save-matmul-outputs", 1904,
           TORCHTITAN_A100),
    _titan("llama2-70b", "a100-80g", 64, 2, 4096, "full", 353, TORCHTITAN_A100),
    # Its GPUs are not DGX H100s: the target describes them (hardware.py, h100-96g-500w).
    _titan("llama3-8b", "h100-96g-500w", 8, 2, 8192, "save-matmul-outputs", 5762,
           TORCHTITAN_H100),
    Run("maxtext-llama2-70b-v6e", "llama2-70b", "tpu-v6e", "fsdp", {"fsdp": 256}, 1024, 4096,
        "full", 900, MAXTEXT_V6E, fitted=True),
    # Added later, listed before any prediction for them was computed: the rest of MaxText's
    # Gold tier for dense models (its Silver 405B row runs on two slices, 512 chips, where
    # the table says 256; its Mixtral rows drop tokens at a capacity factor). The Llama 3.1
    # rows run the llama3 presets (3.1's RoPE scaling changes only rotation frequencies).
    Run("maxtext-llama3.1-8b-v6e", "llama3-8b", "tpu-v6e", "fsdp", {"fsdp": 256}, 1024, 8192,
        remat_lib.custom(offloaded=(remat_lib.LAYER_INPUT, *remat_lib.QKV, "out_proj")),
        7207, MAXTEXT_V6E_LLAMA31),
    Run("maxtext-llama3.1-70b-v6e", "llama3-70b", "tpu-v6e", "fsdp", {"fsdp": 256}, 1280, 8192,
        remat_lib.custom(offloaded=(remat_lib.LAYER_INPUT, *remat_lib.QKV)), 960,
        MAXTEXT_V6E_LLAMA31),
    Run("maxtext-llama2-70b-v5p", "llama2-70b", "tpu-v5p", "fsdp", {"fsdp": 512}, 2048, 4096,
        "save-dot-except-mlpwi", 692, MAXTEXT_V5P, fitted=True),
)


def split(runs=RUNS) -> tuple[list, list]:
  """(fitted, held_out) by the rule in the module docstring."""
  fitted, held, i = [], [], 0
  for r in runs:
    if r.fitted is None:
      (fitted if i % 2 == 0 else held).append(r)
      i += 1
    else:
      (fitted if r.fitted else held).append(r)
  return fitted, held


def predict(run: Run):
  """The planner's Estimate for a published run, on its mesh (ICI first, as
  estimate.split_ici_dcn puts it), attention as its source ran it."""
  from shardlab.plan.training import estimate as est
  from shardlab.plan.training.request import Request
  from shardlab.runtime import hardware
  acc = hardware.get(run.target)
  req = Request.of(model=run.model, global_batch=run.global_batch, seq_len=run.seq_len,
                   remat=run.remat, microbatches=run.microbatches, strategy=run.strategy,
                   target=run.target)
  model = req.model_config()
  if isinstance(run.model, str):  # torchtitan and MaxText run flash attention
    model = dataclasses.replace(model, attention="flash")
  return est.estimate(req, model, acc, est.split_ici_dcn(run.mesh, acc.ici_domain))


def ratio(run: Run) -> float:
  """Predicted / measured tokens/s per device."""
  e = predict(run)
  return e.tokens_per_s / e.n_devices / run.tokens_per_s
