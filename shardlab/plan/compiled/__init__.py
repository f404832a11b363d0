"""Ahead-of-time compiles of the real steps with abstract inputs (nothing allocated), on
simulated CPU devices or a TPU topology, and their comparison with the formulas."""
