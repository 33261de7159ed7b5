"""Deployment wiring, run where an application is deployed (the `kvray serve` driver, Serve's
controller when it calls an import path, the bench's --launch): app.py binds the kvray
application's deployments, liveness.py the /health application, serve_env.py the Ray Serve
settings every process of the cluster starts with. The Serve import paths users' configs name
stay `cluster.app:...` (cluster/app.py)."""
