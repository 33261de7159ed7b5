"""kvray.v1: stubs generated from llm.proto by `python -m cluster.grpc_api.protogen`.

`from kvray.v1 import llm_pb2, llm_pb2_grpc`; the client helpers are in cluster.grpc_api.client.
"""
