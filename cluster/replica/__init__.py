"""Runs inside an engine replica (a Ray Serve replica actor): `LLMServer`, which hosts an
`AsyncEngine`, coalesces its stream deltas, enforces deadlines and queue caps, publishes KV
events and records the engine's metrics."""
