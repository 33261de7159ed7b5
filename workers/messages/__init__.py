"""The engine's boundary messages, imported by both sides of each boundary: `step` (what the
engine core sends its workers each step and what comes back: core <-> executor <-> device)
and `core` (the caller's `EngineProcess` <-> its engine-core child). Plain data: nothing here
runs in one process more than another, so neither side imports the other's code for them."""
