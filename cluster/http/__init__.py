"""The OpenAI-compatible HTTP ingress: a Serve deployment (FastAPI behind Serve's HAProxy)
with its request models, response formatting and SSE streaming."""
