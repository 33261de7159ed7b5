"""kvray smoke test (the chart's `helm test` pod): HTTP /health and /ready, then gRPC health.

usage: python smoke_test.py HTTP_BASE_URL GRPC_TARGET   (exit status 0 = serving)
"""

import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "kvray.v1.LLMService"
TIMEOUT_S = 10


def main(http_base: str, grpc_target: str) -> int:
    for path in ("/health", "/ready"):
        # urlopen raises for any non-2xx answer (503 from /ready: no engine replica healthy).
        with urllib.request.urlopen(http_base.rstrip("/") + path, timeout=TIMEOUT_S) as reply:
            print(f"GET {path}: {reply.status}")
    with grpc.insecure_channel(grpc_target) as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=TIMEOUT_S)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"grpc.health.v1 {SERVICE}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
