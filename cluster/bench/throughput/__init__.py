"""`kvray bench throughput` (main.py): offline throughput of kvray against transformers."""
