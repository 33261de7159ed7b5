"""Benchmarks, run on a laptop or CI, one subpackage each: `kvray bench throughput` (offline,
against transformers), `kvray bench serve` (online, against a running or `--launch`ed server;
its --fault-at and --chaos modes in fault/ and chaos/), `kvray bench step`, `kvray bench
kernels`; common/ holds what they share."""
