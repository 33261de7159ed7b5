"""`kvray bench serve --fault-at` (main.py): kill a replica mid-run and measure what clients
see."""
