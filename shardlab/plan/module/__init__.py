"""Per-device memory of any nnx.Module's train step without compiling (`sl.plan_module`):
state bytes exact, activations from the traced step's saved residuals, temporaries from a
liveness walk of the backward."""
