"""`kvray bench kernels` (main.py): the CPU kernels against torch's ops, per step size."""
