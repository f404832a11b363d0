"""Bundled architectures: users of shardlab's public API, installed as `shardlab.models`.

Any Flax NNX module trains with shardlab (see docs/your-model.md). A *bundled* model also
gives the CLI, planner, inspector and generator what they ask of it, through its config
dataclass (one per architecture, chosen by the preset's `arch` field). That contract is code:
`shardlab.models.protocol` lists the REQUIRED members (name, arch, vocab_size, max_seq_len,
the decoder's shape, make(rngs, param_dtype, remat, lora=None), init_cache, activations,
no_weight_decay, remat_policies, axis_sizes(), n_params, n_layer_params,
flops_per_token(seq_len), n_lora_params(lora), lora_targets, lora_weights) and the OPTIONAL
ones with what their absence means, and `@register("name")` checks a config class against
it when the class registers.

The registry and preset loading are in `shardlab.models.registry`; the core never imports a
concrete architecture. Importing this package imports nothing.
"""
