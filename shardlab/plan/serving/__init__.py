"""Serving a model (`shardlab plan serve`): per-device memory (weights, KV cache,
temporaries), fit, fewest devices per layout and roofline prefill and decode speeds."""
