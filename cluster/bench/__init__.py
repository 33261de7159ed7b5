"""Benchmarks, run on a laptop or CI: `kvray bench throughput` (offline, against transformers)
and `kvray bench serve` (online, against a running or `--launch`ed server)."""
