"""kvray's public API definitions (protobuf / gRPC); the engine and server live elsewhere."""
