"""Engine errors that callers distinguish from bad input (ValueError)."""


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; every in-flight and later request gets this."""
