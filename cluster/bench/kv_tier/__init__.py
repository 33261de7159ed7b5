"""`kvray bench kv-tier` (main.py): TTFT with the cluster KV tier, per prefix length."""
