"""What both ingresses (HTTP and gRPC) share, in their replicas: API keys, the one preparation
of a generation request (prepare.py: prompts and chat templates into token ids, tools, output
constraint, SamplingParams, the check into the engine's types), token text, and the client
that calls the LLMServer deployment."""
