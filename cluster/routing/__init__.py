"""Runs in the caller's deployment handle, i.e. inside the ingress replicas: Serve request
routers that pick an engine replica (prefix affinity, KV events, load) and the ingresses'
and router's metrics."""
