"""The logical axes of the activations shardlab's building blocks constrain: the one list
that a model, generation (the KV cache) and `shardlab inspect --activations` share. A module
of your own that names its activations the same way is sharded the same way by every
strategy.
"""

ACTIVATIONS = {
    "residual": ("batch", "residual_length", "embed"),
    "queries": ("batch", "length", "heads", "head_dim"),  # also the attention output
    "keys_values": ("batch", "length", "kv_heads", "head_dim"),
    "mlp_hidden": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
    "kv_cache": ("layers", "batch", "length", "kv_heads", "head_dim"),
}
QUERIES = ACTIVATIONS["queries"]
KEYS_VALUES = ACTIVATIONS["keys_values"]
