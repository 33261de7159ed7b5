"""The `kvray` command line (runs where the user types it): serve, generate, config, and the
flags built from ServeConfig."""
