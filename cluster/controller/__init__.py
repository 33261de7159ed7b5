"""Runs in Ray Serve's controller: the autoscaling policy of the engine replicas."""
