"""kvray's Serve applications by their import paths, a contract (docs/contracts.md): a Serve
config names `cluster.app:build_app` and `cluster.app:build_liveness_app`, so configs keep
loading whatever moves inside the package. The wiring itself is cluster/deploy/."""

from cluster.deploy.app import build_app
from cluster.deploy.liveness import build_liveness_app

__all__ = ["build_app", "build_liveness_app"]
