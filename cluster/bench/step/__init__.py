"""`kvray bench step` (main.py): one engine step's time, host ops and memory-bandwidth share."""
