"""Bundled architectures: users of shardlab's public API, installed as `shardlab.models`.

Any Flax NNX module trains with shardlab (see docs/your-model.md). A *bundled* model also
gives the CLI, planner, inspector and generator what they ask of it, through its config
dataclass (one per architecture, chosen by the preset's `arch` field):

  name, vocab_size, max_seq_len, arch      fields
  make(rngs, param_dtype, remat[, lora])   -> the nnx.Module (with hidden(), output_head(),
                                              extend(tokens, cache) for generation); `lora`
                                              (a LoraConfig) adds adapters (models/lora.py)
  lora_targets, lora_weights               the projections LoRA may adapt, and the weight
                                              each adapts (for --merge-lora); () if none
  init_cache(batch, length, dtype)         -> its KV cache
  activations                              logical names of the activations it constrains
  no_weight_decay                          param names exempt from weight decay
  remat_policies                           the train.remat values it accepts
  axis_sizes()                             the size of each logical param axis
  n_params, n_layer_params                 exact counts
  flops_per_token(seq_len)                 model FLOPs for MFU

The registry and preset loading are in `shardlab.models.registry`; the core never imports a
concrete architecture.
"""
