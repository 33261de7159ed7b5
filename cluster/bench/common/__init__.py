"""What several benchmarks share: workloads and results (workload.py, result.py), random
checkpoints (random_model.py), the roofline (roofline.py), and the online benchmarks' clients
and --launch cluster (backend_types.py, backends.py, grpc_backend.py, launch.py)."""
