"""The gRPC ingress (`kvray.v1.LLMService`, health, reflection): a Serve deployment running
its own grpc.aio server on the head node, plus the Python client and stub generation."""
