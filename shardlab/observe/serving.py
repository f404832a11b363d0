"""What a generation run reports at the end: prefill and decode tokens/s (compile time kept
apart) and the memory each device holds — weights, KV cache, the decode step's temporaries
by XLA's memory analysis, and the allocator's peak where the backend keeps one (GPU, TPU)."""

import dataclasses

import jax

from shardlab.runtime import units


@dataclasses.dataclass
class ServingReport:
  sequences: int = 0  # rows decoded (samples of every prompt; padding rows excluded)
  batches: int = 0  # prefill + decode loops run (one per prompt length)
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_tokens: int = 0  # generated after the first (the prefill draws the first)
  decode_steps: int = 0  # summed over the batches (one token per sequence of the batch)
  decode_s: float = 0.0
  compile_s: float = 0.0
  weights_bytes: float = 0.0  # per device, the fullest one
  kv_cache_bytes: float = 0.0
  decode_temp_bytes: float = 0.0
  peak_bytes: float | None = None  # the allocator's peak on device 0, where reported

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s else 0.0

  @property
  def decode_tokens_per_s_per_seq(self) -> float:
    """Steps per second: every sequence gains one token a step."""
    return self.decode_steps / self.decode_s if self.decode_s else 0.0

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), prefill_tokens_per_s=self.prefill_tokens_per_s,
                decode_tokens_per_s=self.decode_tokens_per_s,
                decode_tokens_per_s_per_seq=self.decode_tokens_per_s_per_seq)

  def measure(self, params, cache, compiled_decode, device) -> None:
    """Per-device bytes of the weights and the cache, the decode step's temporaries."""
    self.weights_bytes = per_device_bytes(params)
    self.kv_cache_bytes = max(self.kv_cache_bytes, per_device_bytes(cache))
    mem = compiled_decode.memory_analysis()
    if mem is not None:
      temp = mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
      self.decode_temp_bytes = max(self.decode_temp_bytes, temp)
    self.peak_bytes = peak_bytes(device)

  def lines(self) -> list[str]:
    peak = "" if self.peak_bytes is None else f", allocator peak {_size(self.peak_bytes)}"
    return [
        f"prefill  {self.prefill_tokens} prompt tokens in {self.prefill_s:.3f} s: "
        f"{self.prefill_tokens_per_s:,.0f} tokens/s",
        f"decode   {self.sequences} sequences, {self.decode_steps} steps in "
        f"{self.decode_s:.3f} s: {self.decode_tokens_per_s_per_seq:,.1f} tokens/s per "
        f"sequence, {self.decode_tokens_per_s:,.0f} in total ({self.batches} batch(es); "
        f"compile {self.compile_s:.1f} s not counted)",
        f"memory   per device: weights {_size(self.weights_bytes)}, KV cache "
        f"{_size(self.kv_cache_bytes)}, decode step temporaries "
        f"{_size(self.decode_temp_bytes)} (XLA){peak}"]


def _size(nbytes: float) -> str:
  return units.size(nbytes, digits=3)


def per_device_bytes(tree) -> float:
  """The most bytes any one device holds of the arrays in `tree`."""
  held: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return float(max(held.values(), default=0))


def peak_bytes(device) -> float | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return float(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
