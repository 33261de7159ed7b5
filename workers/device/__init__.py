"""Owns a device: one tensor-parallel rank's weights and KV-cache shard, the model runner,
layers, kernels and sampler. Runs in the worker (a Ray actor, or the core's process for
TP = 1)."""
