"""Speculative decoding: cheap proposals of a sequence's next tokens, verified by the target in
one forward (workers/core/speculator.py). See config.py for the settings."""
