"""The building blocks any NNX module composes, each doing the right thing from the step's
rules and mesh (shardlab.sharding.activations: what `sl.train_step` sets while it traces)
and the plain single-device thing anywhere else. The bundled architectures (shardlab.models)
are built from these names only.

    from shardlab import parallel as slp
    out = slp.attention(q, k, v, segment_ids=seg, impl="auto")   # flash / ring / cuDNN / splash
    x = slp.scan_layers(self.blocks, x, remat="full", unroll=1)  # scan, remat, or a pipeline
    y, kept = slp.experts(x, ids, weights, (gate, up, down), "dropless", 1.0)
    loss = slp.cross_entropy(hidden, head, targets, chunk=512)

See docs/your-model.md for each with a runnable snippet.
"""

from shardlab.parallel.adapters import LoraWeight, add_lora, lora_einsum, lora_frozen, merge_lora
from shardlab.parallel.attention import attend, attention, causal_mask
from shardlab.parallel.context import KV_EXCHANGES, document_positions, is_context_parallel
from shardlab.parallel.context import zigzag
from shardlab.parallel.dispatch import MODES as DISPATCH_MODES, run as experts
from shardlab.parallel.dispatch import swiglu_expert
from shardlab.parallel.dot import einsum
from shardlab.parallel.early_grads import reduce_grads_early
from shardlab.parallel.flash import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from shardlab.parallel.lora import PREFIX as LORA_PREFIX, Adapter, adapter_rngs
from shardlab.parallel.lora import maybe as lora_adapter, project as lora_project
from shardlab.parallel.lora import for_weight as lora_for_weight
from shardlab.parallel.lora import project_target as lora_project_target
from shardlab.parallel.loss import cross_entropy
from shardlab.parallel.mlp import swiglu
from shardlab.parallel.names import ACTIVATIONS
from shardlab.parallel.routing import route, router_stats
from shardlab.parallel.scan import LAYER_INPUT, REMAT_POLICIES, scan, scan_layers
from shardlab.parallel.schedule_1f1b import loss as pipeline_1f1b
from shardlab.parallel.schedule_1f1b import value_and_grads as pipeline_1f1b_grads
from shardlab.parallel.softmax import SCORES as ATTENTION_SCORES
from shardlab.parallel.stack_1f1b import PipelineParts, pipeline_1f1b_loss
from shardlab.parallel.stack_1f1b import active as pipeline_1f1b_active
from shardlab.sharding.activations import constrain, current, platform, step_context
from shardlab.sharding.params import param, stacked_param

__all__ = [
    "ACTIVATIONS", "ATTENTION_IMPLEMENTATIONS", "ATTENTION_SCORES", "Adapter",
    "DISPATCH_MODES", "KV_EXCHANGES", "LAYER_INPUT", "LORA_PREFIX", "LoraWeight",
    "PipelineParts", "REMAT_POLICIES",
    "adapter_rngs", "add_lora", "attend", "attention", "causal_mask", "constrain",
    "cross_entropy", "current", "document_positions", "einsum", "experts",
    "is_context_parallel", "lora_adapter", "lora_einsum", "lora_for_weight", "lora_frozen",
    "lora_project", "lora_project_target", "merge_lora", "param", "pipeline_1f1b", "pipeline_1f1b_active", "pipeline_1f1b_grads",
    "pipeline_1f1b_loss", "platform", "reduce_grads_early", "route", "router_stats", "scan",
    "scan_layers", "stacked_param", "step_context", "swiglu", "swiglu_expert", "zigzag",
]
