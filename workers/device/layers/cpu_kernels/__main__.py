"""`python -m workers.device.layers.cpu_kernels`: builds the kernel library ahead of time."""

from workers.device.layers.cpu_kernels.build import main

main()
