"""Generation: seeded sampling is deterministic, the KV cache changes no token, and
`shardlab generate` samples from a checkpoint on its own or another mesh."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import helpers
from shardlab.training import checkpoint
from shardlab import config
from shardlab import generate
from shardlab.cli import generate as generate_cli
from shardlab.cli import text
from shardlab.errors import ConfigError
from shardlab.models import registry
from shardlab.data import tokenizer

PROMPT = np.array([100, 101, 102, 32, 120], np.int32)
BYTES = tokenizer.ByteTokenizer()
# One sampling setup (and prompt length) for most tests, so each strategy compiles it once.
SAMPLING = generate.Sampling(max_new_tokens=12, temperature=1.0, top_k=20, seed=3,
                             num_samples=3)


@functools.cache
def generator(strategy: str):
  run = helpers.run(strategy)
  return run, generate.Generator(run.cfg, run.abstract, run.sh)


@pytest.mark.parametrize("strategy", ["fsdp_tp", "tp"])
def test_cached_decoding_matches_uncached(strategy):
  run, gen = generator(strategy)
  cached = gen.tokens(run.init.params, PROMPT, SAMPLING)
  assert cached.shape == (3, 12) and cached.dtype == np.int32
  np.testing.assert_array_equal(cached, gen.tokens(run.init.params, PROMPT, SAMPLING,
                                                   use_cache=False))



def test_decoding_stops_once_every_row_drew_an_eos():
  """Greedy rows that draw an EOS end the loop within STOP_CHECK_EVERY steps; each row's
  tokens after its EOS repeat it, and only tokens up to the EOS count as generated."""
  run, gen = generator("fsdp_tp")
  s = generate.Sampling(max_new_tokens=40, temperature=0.0, top_k=0)
  prompts = [PROMPT, PROMPT[::-1].copy()]
  full, report = gen.generate(run.init.params, prompts, s)
  assert report.decode_steps == 39 and full[0].shape == (1, 40)
  # An EOS each row draws early: the tokens at indices 2 and 4 of the two rows.
  eos = (int(full[0][0, 2]), int(full[1][0, 4]))
  stops = [min(np.flatnonzero(np.isin(f[0], eos))) for f in full]
  stopped, report = gen.generate(run.init.params, prompts, dataclasses.replace(s, eos_ids=eos))
  every = generate.STOP_CHECK_EVERY
  assert report.decode_steps == every - 1 < 39  # the first look, after `every` tokens
  assert report.decode_tokens == sum(stops)  # each row's tokens after the first, to its EOS
  for row, f, stop in zip(stopped, full, stops):
    assert row.shape == (1, every)
    np.testing.assert_array_equal(row[0, :stop + 1], f[0, :stop + 1])
    assert (row[0, stop:] == f[0, stop]).all()
  assert text.decode(BYTES, stopped[0], eos) == text.decode(BYTES, full[0][:, :stops[0]])


def test_seeded_sampling_is_deterministic():
  run, gen = generator("fsdp_tp")
  s = dataclasses.replace(SAMPLING, seed=7, num_samples=2)
  first = gen.tokens(run.init.params, PROMPT, s)
  np.testing.assert_array_equal(first, gen.tokens(run.init.params, PROMPT, s))
  other = gen.tokens(run.init.params, PROMPT, dataclasses.replace(s, seed=8))
  assert not np.array_equal(first, other)
  assert not np.array_equal(first[0], first[1])  # each sample draws its own tokens


def test_bad_requests_name_the_field():
  run, gen = generator("fsdp_tp")
  with pytest.raises(ConfigError, match="max_seq_len"):
    gen.tokens(run.init.params, PROMPT, generate.Sampling(max_new_tokens=64))
  with pytest.raises(ConfigError, match="temperature"):
    generate.Sampling(temperature=-1.0)
  with pytest.raises(ConfigError, match="at least one token"):
    gen.tokens(run.init.params, text.encode(BYTES, ""), generate.Sampling(max_new_tokens=4))


def test_generate_cli_from_a_checkpoint(tmp_path, capsys):
  run = helpers.run("fsdp_tp")
  ckpt = checkpoint.Checkpointer(config.CheckpointConfig(dir=str(tmp_path), async_save=False))
  ckpt.save(run.init, config.to_dict(run.cfg), {"step": 3}, force=True)
  ckpt.close()
  assert registry.run_config_from_dict(checkpoint.saved_config(tmp_path)) == run.cfg

  args = ["--checkpoint", str(tmp_path), "--prompt", "def f", "--max-new-tokens", "8",
          "--seed", "1", "--quiet"]
  assert generate_cli.generate_main(args) == 0
  first = capsys.readouterr().out
  assert first.startswith("def f") and len(first.rstrip("\n")) >= len("def f")
  # The same checkpoint on another mesh and strategy draws the same bytes.
  assert generate_cli.generate_main(args + ["--mesh", "data:2,tensor:4", "--strategy",
                                            "tp"]) == 0
  assert capsys.readouterr().out == first
  assert generate_cli.generate_main(["--checkpoint", str(tmp_path / "none")]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_text_decodes_bytes_with_replacement():
  run, gen = generator("fsdp_tp")
  prompt = text.encode(BYTES, "dé =")  # 5 bytes, like PROMPT
  texts = text.decode(BYTES, gen.tokens(run.init.params, prompt, SAMPLING))
  assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
  assert any("\ufffd" in t for t in texts)  # random weights draw invalid UTF-8 somewhere
  assert jax.tree.leaves(run.init.params)  # params were not donated


def test_sample_greedy_top_k_and_byte_vocabulary():
  logits = jax.numpy.asarray(np.random.default_rng(0).normal(size=(4, 300)), np.float32)
  logits = logits.at[:, 280].set(100.0)  # the likeliest token is not a byte
  best_byte = np.argmax(np.asarray(logits)[:, :256], axis=-1)
  key = jax.random.key(0)
  np.testing.assert_array_equal(generate.sample(logits, key, 0.0, 0), best_byte)
  np.testing.assert_array_equal(generate.sample(logits, key, 1.0, 1), best_byte)
  drawn = np.asarray(generate.sample(logits, key, 1.0, 5))
  top5 = np.argsort(-np.asarray(logits)[:, :256], axis=-1)[:, :5]
  assert all(d in row for d, row in zip(drawn, top5))

