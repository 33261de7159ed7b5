"""A two-node Ray cluster on this machine, for the node-failure migration test.

`TwoNodeCluster` starts a head (`ray start --head`) and a second raylet joining it
(`ray start --address ...`), each with one `kvray_replica_slot` resource, so that engine
replicas asking for a slot land one per node. The head also has Ray's own
`node:__internal_head__` resource, where the test pins the ingress: the ingress holds each
request's migration state, so it must outlive the node that dies.

`python -m tests.cluster.multinode ADDRESS HTTP_PORT GRPC_PORT OUT.json` is the driver the
test runs against that cluster (its own process: the test process may hold another Ray
connection). It deploys 2 replicas, one per node, starts the 32-request load, SIGKILLs the
worker node's raylet once every stream is under way, and writes what happened to OUT.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, free_port, pids_matching, wait_for

SLOT = "kvray_replica_slot"
HEAD_RESOURCE = "node:__internal_head__"


class TwoNodeCluster:
    """Head + worker raylet on this machine; everything it started is killed on close()."""

    def __init__(self, env: dict[str, str]) -> None:
        # Unix socket paths under the temp dir must stay short: /tmp/krXXXX.
        self.temp_dir = tempfile.mkdtemp(prefix="kr", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = env
        common = ["--num-cpus", "3", "--disable-usage-stats", "--resources", f'{{"{SLOT}": 1}}']
        try:
            self._ray(
                "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                "--temp-dir", self.temp_dir, *common,
            )  # fmt: skip
            self._ray("start", "--address", self.address, *common)
        except BaseException:
            self.close()  # a head without its worker must not outlive the test
            raise

    def _ray(self, *args: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        subprocess.run([ray, *args], env=self.env, check=True, capture_output=True, timeout=120)

    def raylet_pids(self) -> list[int]:
        """This cluster's raylets."""
        return pids_matching(lambda cmd: b"/raylet" in cmd and self._mine(cmd))

    def worker_raylet_pid(self) -> int:
        """The joined node's raylet: the second raylet of a session names its socket
        `raylet.1` (the head's is `raylet`)."""
        (pid,) = pids_matching(lambda cmd: b"/raylet\x00" in cmd and b"sockets/raylet.1" in cmd)
        return pid

    def _mine(self, cmd: bytes) -> bool:
        # Every process of the cluster names its session directory, under this temp dir.
        return self.temp_dir.encode() in cmd

    def close(self) -> None:
        """SIGKILLs every process of this cluster (never another Ray instance's)."""
        for _ in range(5):
            pids = pids_matching(self._mine)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)


def drive(address: str, http_port: int, grpc_port: int, out: Path) -> int:
    import ray
    from ray import serve

    from cluster.config import ServeConfig
    from cluster.deploy.app import ingress_options, llm_server_options
    from cluster.grpc_api.ingress import bind_grpc_ingress, grpc_options
    from cluster.http.ingress import OpenAIIngress
    from cluster.replica.llm_server import LLMServer
    from tests.cluster.migration_load import (
        build_load,
        expected_texts,
        failures,
        start_load,
    )
    from tests.cluster.serve_helpers import replica_stats, wait_until_idle
    from workers.demo import demo_model_dir

    requests = build_load(seed=16)
    expected = expected_texts(demo_model_dir(), requests)
    ray.init(address=address, logging_level="WARNING")
    serve.start(
        proxy_location="HeadOnly",  # both "nodes" share this machine's ports
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=grpc_options(grpc_port),
    )
    config = ServeConfig.from_flat(
        num_replicas=2,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        api_key_env="KVRAY_MULTINODE_NO_KEY",
        # The cluster KV tier: the dead node's blocks die with it (their owner, its store
        # actor, was there); the moved requests then recompute, never a wrong token.
        kv_offload_gib=0.05,
        kv_share_gib=0.1,
    )
    opts = llm_server_options(config)
    # One replica per node: each asks for the one slot a node has.
    opts["placement_group_bundles"][0] = {**opts["placement_group_bundles"][0], SLOT: 1}
    llm = serve.deployment(LLMServer, **opts).bind(config)
    grpc = bind_grpc_ingress(config, llm)
    ing_opts = ingress_options(config)
    pinned = {"resources": {HEAD_RESOURCE: 0.01}}  # the ingress outlives the worker node
    ing_opts["ray_actor_options"] = {**ing_opts["ray_actor_options"], **pinned}
    ingress = serve.deployment(OpenAIIngress, **ing_opts).bind(config, llm, grpc)
    serve.run(ingress, name="multinode", route_prefix="/")
    app = App("multinode", f"http://127.0.0.1:{http_port}", config.engine.model_name(), None)
    head = ray.get_runtime_context().get_node_id()  # the driver runs on the head
    stats = replica_stats(app, 2)
    nodes = {s["node_id"] for s in stats.values()}
    result: dict[str, Any] = {"replica_nodes": len(nodes)}
    load = start_load(app, grpc_port, requests)
    wait_for(lambda: load.streamed_progress() >= 4, "every stream to be under way", 120)
    on_worker = [s for s in replica_stats(app, 2).values() if s["node_id"] != head]
    result["victim_running"] = on_worker[0]["num_requests_running"] if on_worker else 0
    # The test passes this raylet's pid in the environment: the worker node's raylet.
    os.kill(int(os.environ["KVRAY_TEST_KILL_PID"]), signal.SIGKILL)
    result["failures"] = failures(load.wait(), expected)
    # The worker node's replica can still answer for a moment after its raylet died (its
    # process notices late), and once it did, reporting itself idle; the survivor is the
    # replica that answers after that. A bound, not a latency assert: past it, whatever
    # answered is reported and the test's node check fails.
    deadline = time.monotonic() + 60
    while True:
        survivors = wait_until_idle(app, 1)
        if all(s["node_id"] == head for s in survivors.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    result["survivor_blocks"] = [s["kv_blocks_used"] for s in survivors.values()]
    result["survivor_nodes"] = sorted({s["node_id"] == head for s in survivors.values()})
    result["kv_share"] = [s["kv_share"] for s in survivors.values()]
    out.write_text(json.dumps(result))
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(drive(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
