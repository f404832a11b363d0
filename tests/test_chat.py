"""Chat data: the template renders as transformers' apply_chat_template does, the loss mask
is exactly the assistant turns, packing keeps it aligned, and the loss reads only them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers as H

from shardlab.cli.data import data_main
from shardlab.config import DataConfig
from shardlab.data import chat, feed as feed_lib, packing, tokens
from shardlab.data import tokenizer as tokenizer_lib
from shardlab.errors import ConfigError
from shardlab.hf import weights as hf_weights
from shardlab.models import lm
from shardlab.training import step

tokenizers = pytest.importorskip("tokenizers")

START, END = "<|im_start|>", "<|im_end|>"
# ChatML, with a BOS from tokenizer_config.json: assistant turns found by prefix
PREFIX = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
          "m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# the same text, assistant turns marked
MARKERS = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
           "{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>\n' }}"
           "{% endgeneration %}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
           "'<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue, like the sky over the sea."},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green"}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "thanks", "name": None}],  # ends on a prompt turn
]


def _tokenizer_dir(path, template):
  path.mkdir()
  texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["the quick brown fox"]
  tokenizer_lib.train_bpe(texts, 300, path / "tokenizer.json")
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.add_special_tokens([START, END])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
      "bos_token": "<|endoftext|>", "eos_token": END}))
  return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  return {name: _tokenizer_dir(root / name, t) for name, t in
          (("prefix", PREFIX), ("markers", MARKERS))}


def _encode(directory, messages):
  return chat.encode(chat.ChatTemplate(directory), tokenizer_lib.load(str(directory)), messages)


@pytest.mark.parametrize("kind", ["prefix", "markers"])
def test_render_equals_transformers_apply_chat_template(dirs, kind):
  transformers = pytest.importorskip("transformers")
  theirs = transformers.AutoTokenizer.from_pretrained(str(dirs[kind]))
  for messages in CONVERSATIONS:
    ids, mask = _encode(dirs[kind], messages)
    out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=kind == "markers")
    assert ids.tolist() == list(out["input_ids"])
    assert ids[0] == theirs.bos_token_id  # the special tokens reach the template
    if kind == "markers":
      assert mask.tolist() == list(out["assistant_masks"])


def test_an_export_keeps_a_template_saved_as_chat_template_jinja(dirs, tmp_path):
  """transformers 5 saves the template beside the config (chat_template.jinja): `to-hf
  --tokenizer-from` copies it, so the export renders the conversations as the original."""
  transformers = pytest.importorskip("transformers")
  saved, export = tmp_path / "saved", tmp_path / "export"
  transformers.AutoTokenizer.from_pretrained(str(dirs["markers"])).save_pretrained(str(saved))
  assert (saved / chat.TEMPLATE_FILE).is_file()
  export.mkdir()
  assert chat.TEMPLATE_FILE in hf_weights.copy_tokenizer(saved, export)
  for messages in CONVERSATIONS:
    ids, mask = _encode(export, messages)
    want = _encode(dirs["markers"], messages)
    assert ids.tolist() == want[0].tolist() and mask.tolist() == want[1].tolist()


def test_mask_covers_exactly_the_assistant_turns(dirs):
  tok = tokenizer_lib.load(str(dirs["prefix"]))
  for messages in CONVERSATIONS:
    ids, mask = _encode(dirs["prefix"], messages)
    assert mask.tolist() == _encode(dirs["markers"], messages)[1].tolist()
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    runs = [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == [m["content"] + END + "\n" for m in messages if m["role"] == "assistant"]


def test_a_template_that_rewrites_earlier_turns_is_refused(dirs, tmp_path):
  directory = _tokenizer_dir(tmp_path / "t", PREFIX.replace(
      "m['content']", "(m['content'] if loop.last else 'old')"))
  with pytest.raises(ConfigError, match=r"convo:3: the chat template renders assistant "
                                        r"message 2 differently .*generation"):
    chat.encode(chat.ChatTemplate(directory), tokenizer_lib.load(str(directory)),
                CONVERSATIONS[1][:3], "convo:3")
  with pytest.raises(ConfigError, match="has no 'assistant' message"):
    _encode(dirs["prefix"], CONVERSATIONS[0][:1])
  strict = _tokenizer_dir(tmp_path / "s", "{{ raise_exception('roles must alternate') }}")
  with pytest.raises(ConfigError, match="convo:1: the chat template refused the conversation: "
                                        "TemplateError: roles must alternate"):
    chat.encode(chat.ChatTemplate(strict), tokenizer_lib.load(str(strict)), CONVERSATIONS[0],
                "convo:1")


@pytest.fixture(scope="module")
def prepared(dirs, tmp_path_factory):
  root = tmp_path_factory.mktemp("chatdata")
  rng = np.random.default_rng(0)
  convs = [CONVERSATIONS[i] for i in rng.integers(0, len(CONVERSATIONS), 40)]
  source = root / "chat.jsonl"
  source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
  assert data_main(["prepare", str(source), str(root / "out"), "--tokenizer",
                    str(dirs["prefix"]), "--held-out-fraction", "0.1",
                    "--shard-tokens", "200"]) == 0  # auto: the records have `messages`
  return root / "out", convs


def test_prepare_writes_masks_and_packing_keeps_them_aligned(prepared, dirs):
  out, convs = prepared
  index, splits = tokens.read_prepared(out)
  assert index["chat"]["assistant_spans"] == "prefix" and len(splits["train"]) > 1
  held = [int((n + 1) * 0.1) > int(n * 0.1) for n in range(len(convs))]
  expected = [_encode(dirs["prefix"], c) for c, h in zip(convs, held) if not h]
  rows = packing.Rows(splits["train"], 24, "train")  # rows shorter than some conversations
  batch = rows.batch(np.arange(len(rows)))
  assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
  # each row token's (conversation, offset) from the shard layout: its mask is that token's
  doc_base = np.cumsum([0] + [len(s.doc_starts) for s in splits["train"]])
  for r in range(len(rows)):
    shard, start, length = rows.shard_of[r], int(rows.starts[r]), int(rows.lengths[r])
    starts = splits["train"][shard].doc_starts
    at = np.arange(start, start + length)
    doc = np.searchsorted(starts, at, side="right") - 1
    for k, (d, offset) in enumerate(zip(doc + doc_base[shard], at - starts[doc])):
      assert batch["tokens"][r, k] == expected[d][0][offset]
      assert batch["loss_mask"][r, k] == expected[d][1][offset]
    assert not batch["loss_mask"][r, length:].any()  # padding is never trained on
  assert sum(int(m.sum()) for _, m in expected) == index["chat"]["assistant_tokens"]["train"]
  data = feed_lib.PackedFeed(DataConfig(corpus=str(out)), 0, 4, 23)
  assert "assistant tokens" in data.describe()
  assert data.host(0, (0, 4))["loss_mask"].shape == (4, 24)
  # the same file read directly (no prepare) gives the same rows
  direct = feed_lib.PackedFeed(DataConfig(corpus=str(out.parent / "chat.jsonl"),
                                          tokenizer=str(dirs["prefix"]),
                                          held_out_fraction=0.1), 0, 4, 23)
  np.testing.assert_array_equal(direct.host(8, (0, 4))["loss_mask"],
                                data.host(8, (0, 4))["loss_mask"])


@pytest.fixture(scope="module")
def model_and_batch(prepared):
  """The shared reference model (vocab 256) and packed chat rows, ids folded into it."""
  run = H.reference()
  _, splits = tokens.read_prepared(prepared[0])
  rows = packing.Rows(splits["train"], 33, "train")
  batch = {k: jnp.asarray(v) for k, v in rows.batch(np.arange(4)).items()}
  batch["tokens"] = batch["tokens"] % run.cfg.model.vocab_size
  assert 0 < int(batch["loss_mask"].sum()) < int((batch["segment_ids"] > 0).sum())
  return run, batch


def _numpy_loss(run, batch):
  t, seg, mask = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
  forward = jax.jit(lambda p, b: nnx.merge(run.abstract.graphdef, p)(
      b["tokens"][:, :-1], b["positions"][:, :-1], b["segment_ids"][:, :-1]))
  logits = np.asarray(forward(run.init.params, batch), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, t[:, 1:, None], -1)[..., 0]
  w = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0) & (mask[:, 1:] == 1)
  return (nll * w).sum() / w.sum()


@pytest.mark.parametrize("chunk", [0, 8])
def test_masked_loss_equals_a_numpy_reference(model_and_batch, chunk):
  run, batch = model_and_batch
  loss = step.model_loss(lambda m, b: lm.next_token_loss(m, b, chunk), run.abstract)
  np.testing.assert_allclose(float(jax.jit(loss)(run.init.params, batch)[0]),
                             _numpy_loss(run, batch), rtol=1e-5)


def _labelled(model, inputs):
  """next_token_loss of inputs["batch"], whole, but reading inputs["labels"] as targets."""
  unpack = lm._unpack
  lm._unpack = lambda m, b: (unpack(m, b)[0], inputs["labels"], unpack(m, b)[2])
  try:
    return lm.next_token_loss(model, inputs["batch"])
  finally:
    lm._unpack = unpack


def _loss_and_grads(run, batch, labels):
  loss = step.model_loss(_labelled, run.abstract)
  grad = _GRADS.setdefault(run, jax.jit(jax.value_and_grad(lambda p, i: loss(p, i)[0])))
  value, grads = grad(run.init.params, {"batch": batch, "labels": labels})
  return float(value), jax.tree.leaves(grads)


_GRADS = {}


def test_prompt_targets_change_nothing_assistant_targets_do(model_and_batch):
  run, batch = model_and_batch
  vocab, labels = run.cfg.model.vocab_size, batch["tokens"][:, 1:]
  trained = np.asarray(batch["loss_mask"][:, 1:]) == 1
  counted = np.asarray(batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
  prompt = np.argwhere(~trained & counted)[3]
  answer = np.argwhere(trained & counted)[3]
  bump = lambda at: labels.at[tuple(at)].set((labels[tuple(at)] + 1) % vocab)
  base = _loss_and_grads(run, batch, labels)
  assert base[0] > 0
  # one prompt label, and every one at once: bit for bit the same loss and gradients
  for changed in (bump(prompt), jnp.where(trained, labels, (labels + 7) % vocab)):
    loss, grads = _loss_and_grads(run, batch, changed)
    assert loss == base[0]
    for g, b in zip(grads, base[1]):
      np.testing.assert_array_equal(g, b)
  loss, grads = _loss_and_grads(run, batch, bump(answer))
  assert loss != base[0] and any(not np.array_equal(g, b) for g, b in zip(grads, base[1]))
  # without the mask, the same prompt label does count: the test above can fail
  unmasked = {k: v for k, v in batch.items() if k != "loss_mask"}
  assert (_loss_and_grads(run, unmasked, bump(prompt))[0]
          != _loss_and_grads(run, unmasked, labels)[0])


def test_a_batch_without_assistant_tokens_has_zero_loss_and_gradients(model_and_batch):
  run, batch = model_and_batch
  silent = dict(batch, loss_mask=jnp.zeros_like(batch["loss_mask"]))
  loss, grads = _loss_and_grads(run, silent, batch["tokens"][:, 1:])
  assert loss == 0.0
  assert all(not np.asarray(g).any() for g in grads)
