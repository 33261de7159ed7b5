"""What runs in or beside an engine replica: the LLMServer deployment, the message it takes,
the request router (in each caller's handle), stream coalescing, metrics, and the one module
that touches Ray Serve's private internals."""
