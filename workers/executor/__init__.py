"""Runs in the engine core's process and drives the tensor-parallel ranks: the worker in
process for TP = 1 (`base`), Ray worker actors otherwise (`ray_executor`)."""
