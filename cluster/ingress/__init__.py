"""What both ingresses (HTTP and gRPC) share, in their replicas: API keys, prompts and chat
templates into token ids, the one check into the engine's types, token text, and the client
that calls the LLMServer deployment."""
