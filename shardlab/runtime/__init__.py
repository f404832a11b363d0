"""The machine: simulated CPU devices, huge pages for XLA:CPU, jax.distributed, the local
launcher, accelerator specs."""
