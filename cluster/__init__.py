"""kvray on Ray Serve: config, errors, messages and the application builder at the top; one
package per role below, named for where it runs: http, grpc_api and ingress (the ingress
replicas), routing (the caller's deployment handle), replica (an engine replica), controller
(Serve's controller), cli and bench (the user's shell)."""
