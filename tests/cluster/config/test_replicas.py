"""The replicas section: what each replica reserves."""

from __future__ import annotations

from cluster.config import ServeConfig


def test_replica_cpus_set_its_torch_threads() -> None:
    import argparse

    from cluster.cli.flags import add_serve_flags, config_from_flags

    assert (
        ServeConfig().replicas.num_cpus_per_replica == 1
        and ServeConfig().replicas.torch_threads() == 1
    )
    assert ServeConfig.from_flat(num_cpus_per_replica=4).replicas.torch_threads() == 4
    assert ServeConfig.from_flat(num_cpus_per_replica=2.6).replicas.torch_threads() == 3
    assert (
        ServeConfig.from_flat(num_cpus_per_replica=0.25).replicas.torch_threads() == 1
    )  # never 0 threads
    parser = argparse.ArgumentParser()
    add_serve_flags(parser, "127.0.0.1")
    c = config_from_flags(parser.parse_args(["--num-cpus-per-replica", "2.5"]))
    assert c.replicas.num_cpus_per_replica == 2.5
    assert ServeConfig.from_args(c.to_args()) == c
