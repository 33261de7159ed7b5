"""Runs in the caller's process: the offline `LLM`, a replica's `AsyncEngine`, and the two
hosts of an engine core (`EngineThread`: a thread of this process; `EngineProcess`: a child
process, with the messages between the two)."""
