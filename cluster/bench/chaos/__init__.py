"""`kvray bench serve --chaos` (main.py): faults at random under a mixed workload, each answer
checked against what it should have been."""
