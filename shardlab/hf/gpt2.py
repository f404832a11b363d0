"""The GPT-2 family's Hugging Face adapter: `GPT2LMHeadModel` config.json ↔ GPT2Config
(models/gpt2.py, arch "gpt2").

GPT-2's `Conv1D` stores its weight (in, out), the layout of shardlab's params, so c_fc,
c_proj and the attention's c_proj map with no transpose; `c_attn` fuses q, k and v into one
(D, 3·D) weight and one (3·D,) bias (the columns of q, then k, then v, each head-major), split
on import and concatenated on export (adapter.fuse). The head is tied to `wte`. The released
checkpoints store the base model (`wte.weight`, `h.0.…`, no `transformer.` prefix) and the
causal-mask buffers `attn.bias` / `attn.masked_bias`; both layouts read.

Only what models/gpt2.py computes is accepted, else a ConfigError names field and value: the
tanh GELU, a 4·D MLP, LayerNorm with bias (`layer_norm_epsilon` maps to norm_eps),
1/sqrt(head_dim) attention scaling with no per-layer factor, no cross-attention, tied
embeddings. `reorder_and_upcast_attn` is accepted either way: shardlab always takes the
scores and softmax in fp32, which is what it asks for. Dropout (`*_pdrop`) is a training
regulariser, not part of the function: any value is accepted (every released GPT-2 has 0.1)
and none is applied, training here included; export writes 0.0.
"""

from shardlab.errors import ConfigError
from shardlab.hf.adapter import CONFIG_FILE, LAYER, Adapter, Mapping, adapter, fuse

PREFIX = "transformer."  # GPT2LMHeadModel's base model; the released files omit it
# The GPT2Config field -> the alias transformers' attribute_map also reads.
SHAPE = {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_hidden_layers",
         "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
# The activation_functions transformers computes as 0.5·x·(1 + tanh(√(2/π)·(x +
# 0.044715·x³))): models/gpt2.py's jax.nn.gelu(approximate=True).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast")
ENDOFTEXT = 50256  # the GPT-2 tokenizer's <|endoftext|>: its bos and eos


def _block(param: str, hf: str, hf_dims, dims) -> Mapping:
  """A per-layer param of `blocks` ↔ transformer.h.{i}.<hf>."""
  return Mapping(("blocks",) + tuple(param.split(".")), f"{PREFIX}h.{LAYER}.{hf}", hf_dims,
                 dims)


def _norm(param: str, hf: str) -> list[Mapping]:
  return [_block(f"{param}.scale", f"{hf}.weight", ("D",), "D"),
          _block(f"{param}.bias", f"{hf}.bias", ("D",), "D")]


@adapter("gpt2")
class GPT2Adapter(Adapter):
  label = "GPT-2"
  architectures = ("GPT2LMHeadModel",)
  model_types = ("gpt2",)
  fields = {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer",
            "n_heads": "n_head", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon"}
  # config.json field -> (the one value the model computes, why): anything else is refused.
  requires = {"scale_attn_weights": (True, "attention scores are scaled by 1/sqrt(head_dim)"),
              "scale_attn_by_inverse_layer_idx": (False, "no layer scales its scores"),
              "add_cross_attention": (False, "a decoder without cross-attention"),
              "tie_word_embeddings": (True, "the output head is the token embedding")}

  def to_model(self, hf: dict, name: str = "hf", where: str = CONFIG_FILE):
    """The model config of a GPT-2 config.json, or a ConfigError naming what it cannot hold."""
    if not self.claims(hf):
      raise ConfigError(f"{where}: unsupported architecture "
                        f"{(hf.get('architectures') or [hf.get('model_type')])[0]!r}; "
                        f"supported: {self.architectures[0]} (model_type 'gpt2')")
    shape = {k: hf.get(k, hf.get(alias)) for k, alias in SHAPE.items()}
    missing = [k for k, v in shape.items() if v is None]
    if missing:
      raise ConfigError(f"{where} lacks {', '.join(missing)}; a GPT-2 config needs "
                        f"{', '.join(SHAPE)}")
    for key, (expected, why) in self.requires.items():
      if key in hf and hf[key] != expected:
        raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({why}); "
                          f"valid: {expected!r}")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
      raise ConfigError(f"{where}: activation_function={act!r} is not supported (the MLP's "
                        f"GELU is the tanh approximation); valid: "
                        f"{', '.join(map(repr, TANH_GELU))}")
    inner = hf.get("n_inner")
    if inner not in (None, 4 * shape["n_embd"]):
      raise ConfigError(f"{where}: n_inner={inner!r} is not supported (the MLP is 4·n_embd "
                        f"wide); valid: null or {4 * shape['n_embd']}")
    return self.config_class(
        name=name, vocab_size=shape["vocab_size"], d_model=shape["n_embd"],
        n_layers=shape["n_layer"], n_heads=shape["n_head"], max_seq_len=shape["n_positions"],
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))

  def to_hf(self, m, dtype: str) -> dict:
    """A config.json that transformers' GPT2LMHeadModel.from_pretrained loads."""
    return {"architectures": [self.architectures[0]], "model_type": self.model_types[0],
            "vocab_size": m.vocab_size, "n_embd": m.d_model, "n_layer": m.n_layers,
            "n_head": m.n_heads, "n_positions": m.max_seq_len, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps,
            "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, **{key: value for key, (value, _) in self.requires.items()},
            "torch_dtype": dtype, "dtype": dtype, **self._token_ids(m)}

  def _token_ids(self, m) -> dict:
    """<|endoftext|> as bos and eos where the vocabulary holds it (GPT-2's tokenizer)."""
    eot = ENDOFTEXT if m.vocab_size > ENDOFTEXT else None
    return {"bos_token_id": eot, "eos_token_id": eot}

  def generation_config(self, m) -> dict:
    return {"_from_model_config": True, **self._token_ids(m)}

  def tensors(self, m) -> list[Mapping]:
    """Every param of models/gpt2.py, in HF's usual tensor order."""
    qkv = [_block(f"attn.{t}_DxHxE", "attn.c_attn.weight", ("D", "HE"), "DHE") for t in "qkv"]
    bias = [_block(f"attn.{t}_bias_HxE", "attn.c_attn.bias", ("HE",), "HE") for t in "qkv"]
    return [Mapping(("wte_VxD",), f"{PREFIX}wte.weight", ("V", "D"), "VD"),
            Mapping(("wpe_PxD",), f"{PREFIX}wpe.weight", ("P", "D"), "PD"),
            *_norm("attn_norm", "ln_1"), *fuse(*qkv, axis=1), *fuse(*bias, axis=0),
            _block("attn.o_HxExD", "attn.c_proj.weight", ("HE", "D"), "HED"),
            _block("attn.o_bias_D", "attn.c_proj.bias", ("D",), "D"),
            *_norm("mlp_norm", "ln_2"),
            _block("mlp.fc_DxF", "mlp.c_fc.weight", ("D", "F"), "DF"),
            _block("mlp.fc_bias_F", "mlp.c_fc.bias", ("F",), "F"),
            _block("mlp.proj_FxD", "mlp.c_proj.weight", ("F", "D"), "FD"),
            _block("mlp.proj_bias_D", "mlp.c_proj.bias", ("D",), "D"),
            Mapping(("final_norm", "scale"), f"{PREFIX}ln_f.weight", ("D",), "D"),
            Mapping(("final_norm", "bias"), f"{PREFIX}ln_f.bias", ("D",), "D")]

  def sizes(self, m) -> dict[str, int]:
    return {"V": m.vocab_size, "P": m.max_seq_len, "D": m.d_model, "H": m.n_heads,
            "E": m.head_dim, "F": m.mlp_dim}

  def unread(self, m) -> set[str]:
    """The tied head's copy and the causal-mask buffers older checkpoints carry."""
    return {"lm_head.weight"} | {f"{PREFIX}h.{i}.attn.{b}" for i in range(m.n_layers)
                                 for b in ("bias", "masked_bias")}

  def reader(self, found, m):
    """The files' tensors under GPT2LMHeadModel's names, whichever layout they use."""
    return found if any(n.startswith(PREFIX) for n in found.tensors) else BaseModelReader(found)


class BaseModelReader:
  """A hf_files.Reader of a base-model checkpoint (`wte.weight`, `h.0.…`) whose tensors read
  under GPT2LMHeadModel's names (`transformer.wte.weight`, …)."""

  def __init__(self, reader):
    self.reader = reader
    self.names = {n if n.startswith("lm_head.") else PREFIX + n: n for n in reader.tensors}
    self.tensors = {name: reader.tensors[n] for name, n in self.names.items()}

  def read(self, name: str, box=None):
    return self.reader.read(self.names[name], box)
