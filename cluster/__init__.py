"""kvray on Ray Serve: config, errors and the application builder at the top; one package
per role below (http, grpc_api, ingress, server, cli, bench)."""
