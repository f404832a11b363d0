"""The analytic training planner: per-device memory, fit, fewest devices, communication, a
roofline step time and a mesh search for a training run, from its abstract state and the
shardings the train step uses (no devices, no memory); and the per-tensor layout
(`layout`, `shardlab inspect`)."""
