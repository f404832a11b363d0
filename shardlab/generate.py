"""Sampling text from a trained model: a KV cache, temperature and top-k, sharded by the
strategy's rules.

The prefill runs the prompt once and fills the cache; each decode step runs one token. Both
are jitted with shardings from the rules that train the model: parameters as in training, the
cache by `rules.spec` over the activation table (its batch axis follows the rule for `batch`,
its kv_heads the rule for `kv_heads`: tensor under tp). The batch is padded to a multiple of
the batch shards, so one sample can be drawn on any mesh. The sample at position t uses the
key fold_in(seed, t), so cached and uncached decoding draw the same tokens. With
`Sampling.eos_ids` the decode loop ends once every row has drawn one (checked on the host every
STOP_CHECK_EVERY steps); a row's tokens after its first EOS repeat that EOS. Text in and out
goes through the run's tokenizer (cli/text.py).
"""

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardlab.bounds import Float, Int, check_fields
from shardlab.config import Config
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.observe.serving import ServingReport
from shardlab.sharding import rules as rules_lib
from shardlab.sharding.activations import activation_rules
from shardlab.data import corpus as corpus_lib
from shardlab.training import checkpoint, precision
from shardlab.training import run as run_lib
from shardlab.training.state import Abstract, Shardings


# Sampling's ranges (its check and `shardlab generate`'s options); the steps take an int32 seed.
BOUNDS = {"max_new_tokens": Int(min=1), "num_samples": Int(min=1), "seed": Int(min=0, lt=2**31),
          "temperature": Float(min=0, note="0 is greedy"),
          "top_k": Int(min=0, note="0 keeps every token")}


@dataclasses.dataclass(frozen=True)
class Sampling:
  max_new_tokens: int = 200
  temperature: float = 0.8  # 0: greedy
  top_k: int = 40  # 0: the whole vocabulary
  seed: int = 0
  num_samples: int = 1
  vocab: int = corpus_lib.VOCAB  # ids 0..vocab-1 can be drawn: bytes, or a tokenizer's vocabulary
  eos_ids: tuple[int, ...] = ()  # a row is done once it draws one; the loop ends when all are

  def __post_init__(self):
    check_fields(self, BOUNDS, "")


def sample(logits_BxV, key, temperature: float, top_k: int, vocab: int = corpus_lib.VOCAB):
  """Next tokens from fp32 logits; only ids below `vocab` can be drawn."""
  logits = logits_BxV[:, :vocab].astype(jnp.float32)
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


PREFILL_CHUNK = 512  # tokens per prefill call (the planner's default too)
STOP_CHECK_EVERY = 8  # decode steps between the host's looks for EOS (each waits for them)


class EosStop:
  """Whether every real row has drawn an EOS, from the tokens decoded so far."""

  def __init__(self, eos_ids: tuple[int, ...], real: int, every: int = STOP_CHECK_EVERY):
    self.eos, self.real, self.every = np.asarray(eos_ids, np.int32), real, every
    self.done, self.checked = np.zeros(real, bool), 0

  def all_done(self, out: list) -> bool:
    if not self.eos.size or len(out) - self.checked < self.every:
      return False
    new = np.stack(jax.device_get(out[self.checked:]), axis=1)[:self.real]
    self.done |= np.isin(new, self.eos).any(axis=1)
    self.checked = len(out)
    return bool(self.done.all())

  def finish(self, tokens_RxN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens with each row's first EOS repeated after it, tokens generated per row: up to
    and including that EOS)."""
    hit = np.isin(tokens_RxN, self.eos)
    lengths = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, tokens_RxN.shape[1])
    last = np.take_along_axis(tokens_RxN, lengths[:, None] - 1, axis=1)
    return np.where(np.arange(tokens_RxN.shape[1]) >= lengths[:, None], last, tokens_RxN), lengths


class Generator:
  """Jitted prefill, decode step and (for checking) uncached step for one model, mesh and
  rules (the training rules, the sequence unsplit: rules.sequence_unsplit). jit compiles
  once per batch size, cache length and sampling settings."""

  def __init__(self, cfg: Config, abstract: Abstract, sh: Shardings,
               prefill_chunk: int = PREFILL_CHUNK):
    if prefill_chunk < 1:
      raise ConfigError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
    sh = dataclasses.replace(sh, rules=rules_lib.sequence_unsplit(sh.rules))
    self.cfg, self.abstract, self.sh = cfg, abstract, sh
    # Prompts are prefilled this many tokens at a time: attention's scores over the cache
    # and the logits grow with the chunk, not the prompt.
    self.prefill_chunk = prefill_chunk
    self.batch_shards = math.prod(sh.mesh.shape[a] for a in sh.rules.batch_axes
                                  if a in sh.mesh.shape)
    self._jitted: dict = {}
    # XLA:CPU runs each simulated device's programs on a shared thread pool: with many small
    # collective programs in flight, devices can block in different programs' rendezvous
    # and deadlock (seen on a DCN-ordered mesh). One token at a time there.
    self.sync_each_step = sh.mesh.devices.flat[0].platform == "cpu"

  def _spec(self, names: tuple, shape: tuple, what: str) -> NamedSharding:
    return NamedSharding(self.sh.mesh, rules_lib.spec(names, shape, self.sh.rules.activations,
                                                      self.sh.mesh, what))

  def cache_sharding(self, batch: int, length: int):
    """The model's cache tree: buffers by its `kv_cache` activation names, scalars
    (the write index) replicated."""
    names = self.cfg.model.activations["kv_cache"]
    dtype = self.abstract.policy.compute_dtype
    shapes = jax.eval_shape(lambda: self.cfg.model.init_cache(batch, length, dtype))
    return jax.tree.map(lambda a: self._spec(names, a.shape, "kv cache") if a.ndim == len(names)
                        else NamedSharding(self.sh.mesh, PartitionSpec()), shapes)

  def _model(self, params):
    return nnx.merge(self.abstract.graphdef,
                     precision.cast_for_compute(params, self.abstract.policy))

  def _steps(self, batch: int, length: int, s: Sampling):
    key = (batch, length, s.temperature, s.top_k, s.vocab)
    if key in self._jitted:
      return self._jitted[key]
    mesh, rules = self.sh.mesh, self.sh.rules
    params_sh = self.sh.on_device.params
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens_sh = self._spec(("batch", None), (batch, 1), "prompt")
    row_sh = self._spec(("batch",), (batch,), "generated tokens")
    cache_sh = self.cache_sharding(batch, length)
    draw = lambda logits, seed, position: sample(
        logits, jax.random.fold_in(jax.random.key(seed), position), s.temperature, s.top_k,
        s.vocab)

    def new_cache():
      return self.cfg.model.init_cache(batch, length, self.abstract.policy.compute_dtype)

    def extend(params, tokens_BxT, cache, seed):
      with activation_rules(mesh, rules):
        logits, cache = self._model(params).extend(tokens_BxT, cache)
        return draw(logits[:, -1], seed, cache.index), cache

    def uncached(params, tokens_BxS, position, seed):
      """The token at `position` from a full forward pass over the (padded) sequence."""
      with activation_rules(mesh, rules):
        logits = self._model(params)(tokens_BxS)
        last = jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
        token = draw(last, seed, position)
        return jax.lax.dynamic_update_index_in_dim(tokens_BxS, token, position, axis=1)

    steps = {
        "new_cache": jax.jit(new_cache, out_shardings=cache_sh),
        "prefill": jax.jit(extend, in_shardings=(params_sh, tokens_sh, cache_sh, replicated),
                           out_shardings=(row_sh, cache_sh), donate_argnums=2),
        "decode": jax.jit(lambda p, token_B, cache, seed: extend(p, token_B[:, None], cache,
                                                                 seed),
                          in_shardings=(params_sh, row_sh, cache_sh, replicated),
                          out_shardings=(row_sh, cache_sh), donate_argnums=2),
        "uncached": jax.jit(uncached, in_shardings=(params_sh, tokens_sh, replicated,
                                                    replicated),
                            out_shardings=tokens_sh, donate_argnums=1),
        "tokens_sharding": tokens_sh, "row_sharding": row_sh, "cache_sharding": cache_sh,
    }
    self._jitted[key] = steps
    return steps

  def lower_decode(self, batch: int, length: int):
    """The greedy decode step for `batch` rows and a cache of `length`, lowered with abstract
    sharded inputs: nothing is allocated (`plan serve --compile`)."""
    steps = self._steps(batch, length, Sampling(temperature=0.0, top_k=0))
    place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    params = jax.tree.map(place, self.abstract.state.params, self.sh.on_device.params)
    cache = jax.tree.map(place, jax.eval_shape(lambda: self.cfg.model.init_cache(
        batch, length, self.abstract.policy.compute_dtype)), steps["cache_sharding"])
    token = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=steps["row_sharding"])
    return steps["decode"].lower(params, token, cache, jax.ShapeDtypeStruct((), jnp.int32))

  def tokens(self, params, prompt: np.ndarray, s: Sampling, use_cache: bool = True):
    """num_samples × ≤ max_new_tokens int32 tokens following the 1-D `prompt`."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if not use_cache:
      return self._uncached(params, prompt, s)
    return self.generate(params, [prompt], s)[0][0]

  def generate(self, params, prompts: list, s: Sampling,
               report: ServingReport | None = None) -> tuple[list[np.ndarray], ServingReport]:
    """num_samples × ≤ max_new_tokens tokens (fewer once all drew an EOS) for each 1-D
    prompt, and the run's report. Prompts of one length share a batch (one prefill, one
    decode loop): the cache has one write position for all its rows."""
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    params = jax.device_put(params, self.sh.on_device.params)  # a run's may be on the host
    report = report or ServingReport()
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
      self._check_length(len(p), s.max_new_tokens)
      groups.setdefault(len(p), []).append(i)
    out: list = [None] * len(prompts)
    for indices in groups.values():
      rows = np.repeat(np.stack([prompts[i] for i in indices]), s.num_samples, axis=0)
      new = self._batch(params, rows, s, report)
      for j, i in enumerate(indices):
        out[i] = new[j * s.num_samples:(j + 1) * s.num_samples]
    return out, report

  def _check_length(self, p: int, n: int) -> None:
    if p == 0:
      raise ConfigError("the prompt must hold at least one token (one byte)")
    if p + n > self.cfg.model.max_seq_len:
      raise ConfigError(f"prompt ({p} tokens) + max_new_tokens ({n}) = {p + n} exceeds "
                        f"model.max_seq_len ({self.cfg.model.max_seq_len})")

  def _compiled(self, steps: dict, name: str, *args):
    """The step compiled ahead (its compile time kept out of the tokens/s)."""
    key = ("compiled", name, args[1].shape)
    if key not in steps:
      steps[key] = steps[name].lower(*args).compile()
    return steps[key]

  def _batch(self, params, prompts_RxP: np.ndarray, s: Sampling, report: ServingReport):
    """Prefill and decode one batch of equal-length prompts (rows padded to a multiple of
    the batch shards with copies of the last); the real rows' new tokens."""
    real, (p, n) = len(prompts_RxP), (prompts_RxP.shape[1], s.max_new_tokens)
    rows = -(-real // self.batch_shards) * self.batch_shards
    tokens = np.concatenate([prompts_RxP, np.repeat(prompts_RxP[-1:], rows - real, axis=0)])
    steps, seed = self._steps(rows, p + n, s), np.int32(s.seed)
    start = time.perf_counter()
    cache = steps["new_cache"]()
    chunks = [tokens[:, i:i + self.prefill_chunk] for i in range(0, p, self.prefill_chunk)]
    prefill = [self._compiled(steps, "prefill", params, c, cache, seed) for c in chunks]
    token_sds = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=steps["row_sharding"])
    decode = self._compiled(steps, "decode", params, token_sds, cache, seed)
    begin = time.perf_counter()
    report.compile_s += begin - start
    for step, chunk in zip(prefill, chunks):  # the last chunk's draw is the first token
      token, cache = step(params, chunk, cache, seed)
    out, stop = [jax.block_until_ready(token)], EosStop(s.eos_ids, real)
    decoding = time.perf_counter()
    while len(out) < n and not stop.all_done(out):
      if self.sync_each_step:
        token.block_until_ready()
      token, cache = decode(params, token, cache, seed)
      out.append(token)
    new, lengths = stop.finish(np.stack(jax.device_get(out), axis=1)[:real])
    report.prefill_s += decoding - begin
    report.decode_s += time.perf_counter() - decoding
    report.sequences, report.batches = report.sequences + real, report.batches + 1
    report.prefill_tokens += real * p
    report.decode_tokens += int(lengths.sum()) - real  # not those after a row's EOS
    report.decode_steps += len(out) - 1
    report.measure(params, cache, decode, self.sh.mesh.devices.flat[0])
    return new

  def _uncached(self, params, prompt: np.ndarray, s: Sampling):
    """The same tokens by a full forward pass per token (for checking; no stop at EOS)."""
    p, n = len(prompt), s.max_new_tokens
    self._check_length(p, n)
    rows = -(-s.num_samples // self.batch_shards) * self.batch_shards
    steps, seed = self._steps(rows, p + n, s), np.int32(s.seed)
    seq = np.zeros((rows, p + n), np.int32)
    seq[:, :p] = prompt
    seq = jax.device_put(seq, steps["tokens_sharding"])
    for position in range(p, p + n):
      if self.sync_each_step:
        seq.block_until_ready()
      seq = steps["uncached"](params, seq, np.int32(position), seed)
    return np.asarray(jax.device_get(seq))[:s.num_samples, p:]


def from_checkpoint(directory: str, mesh: str | None = None, strategy: str | None = None,
                    strict: bool = False, warn=None, prefill_chunk: int = PREFILL_CHUNK):
  """(Generator, params, cfg, step) for the newest intact checkpoint in `directory` (a
  damaged newer step is skipped with a warning, or refused if `strict`), on its saved mesh
  and strategy unless others are given."""

  def read(restore, step):
    cfg = registry.run_config_from_dict(restore("config"), f"checkpoint {directory}/{step}")
    cfg = dataclasses.replace(cfg, mesh=mesh or cfg.mesh, strategy=strategy or cfg.strategy)
    p = run_lib.place(cfg)
    params = restore("params", p.abstract.state.params, p.shardings.state.params)
    return Generator(cfg, p.abstract, p.shardings, prefill_chunk), params, cfg

  (gen, params, cfg), step = checkpoint.restore_newest(
      directory, read, "--strict" if strict else None, warn)
  return gen, params, cfg, step
