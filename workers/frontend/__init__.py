"""Runs in the caller's process: the offline `LLM`, a replica's `AsyncEngine`, and the two
hosts of an engine core (`EngineThread`: a thread of this process; `EngineProcess`: the
caller's side of a child process, whose own side is `workers.core.engine_child` and whose
messages are `workers.messages.core`)."""
