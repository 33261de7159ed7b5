"""`kvray bench serve` (main.py): online latency and throughput against a server, its
workloads (LoRA, structured outputs, tenants) and the --overload mode."""
