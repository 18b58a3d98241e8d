"""Tensor parallelism: the process group (parallel_state) and how a model is split (sharding)."""
