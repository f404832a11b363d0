"""Planning with nothing allocated, one question per sub-package:

  training/  how much memory, how many devices and which mesh for a training run (formulas
             over the run's abstract state and shardings), and where each tensor lives
  module/    the same memory question for any nnx.Module, read off its traced train step
  serving/   memory, fit, fewest devices and roofline speeds for serving a model
  compiled/  ahead-of-time compiles of the real steps, set beside the formulas
  auto/      the layout search that picks a run's mesh and strategy

The sub-packages import nothing on import (`from shardlab.plan.training import planner`)."""
