"""The engine core: schedules, pages the KV cache, detokenizes and stops sequences. It runs
in the core's thread or child process (`engine_child`: that process's loop), reaches devices
only through `workers.executor`, and never imports torch (tests/test_imports.py holds it to
that)."""
