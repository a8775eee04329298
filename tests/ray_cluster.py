"""A real multi-node Ray cluster on one machine: a head started with `ray start --head` and
worker nodes started with `ray start --address`, each with its own raylet, object store and
custom resources, all on 127.0.0.1. Tests (and benchmarks/scaling.py) start, kill and add
nodes; only the processes of this cluster are ever touched.

`ray start` turns a loopback address into the machine's outward one (Ray's
`resolve_ip_for_localhost`) and refuses worker nodes when told to stay on loopback; nodes are
started through `ray_start_loopback` below, which is `ray start` with that one rewrite undone."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LOOPBACK_START = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  \
# inherited: addresses Ray derives in the node's processes stay on loopback
import ray._private.ray_constants as constants
from ray._private import services
constants.ENABLE_RAY_CLUSTER = True  # worker nodes are allowed although addresses stay on loopback
services.resolve_ip_for_localhost = lambda host: host
# `ray start` gives its raylet 30 s to register with the GCS, a budget one busy 2-core machine
# overran (a CI run: "The current node timed out during startup", RPC Deadline Exceeded, while
# the other test worker ran an engine). The node gets 180 s here; a cluster node would not.
import time
ask_gcs = services.get_node
def get_node_patiently(gcs_address, node_id):
    deadline = time.monotonic() + 180
    while True:
        try:
            return ask_gcs(gcs_address, node_id)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
services.get_node = get_node_patiently
from ray.scripts.scripts import main
sys.exit(main())
"""


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never one this process handed out before: the kernel
    may give a port just closed again, and `ray start` refuses two of its components on one
    port (a run failed so: dashboard_agent_grpc and dashboard_agent_http both got 58507)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Node:
    name: str
    manager_port: int
    resources: dict
    node_id: str = ""


class LocalCluster:
    """Nodes of one Ray cluster on 127.0.0.1. `env` is what a driver needs to join it
    (RAY_ADDRESS, the auth token, the temp dir): pass it to the CLI's subprocess."""

    def __init__(self, head_cpus: int = 4, object_store_mb: int = 200, health_check_period_ms: int = 1000):
        self.temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")  # short: socket paths must fit 107 bytes
        self.object_store_bytes = object_store_mb * 1024 * 1024
        token = Path(self.temp_dir, "token")
        token.write_text(secrets.token_hex(32))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "RAY_TMPDIR": self.temp_dir,
            # Explicit: Ray turns token auth on by itself when ~/.ray/auth_token exists (left by
            # any earlier ray.init on the machine), and a worker node without it cannot join.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            # A driver's own address is loopback, like the nodes' (see LOOPBACK_START).
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_ADDRESS": self.address,
        }
        self.nodes: dict[str, Node] = {}
        # The GCS declares a node dead after 5 failed health checks: every second here, so a
        # killed node is dead to the cluster in about 5 s (Ray's default, every 3 s: about 15 s).
        self.head_env = {**self.env, "RAY_health_check_period_ms": str(health_check_period_ms)}
        self._start(
            "head",
            [
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
            ],
            {"head": 1},
            head_cpus,
        )

    def add_node(self, name: str, resources: dict, cpus: int = 2) -> Node:
        return self._start(name, [f"--address={self.address}"], resources, cpus)

    def _start(self, name: str, args: list[str], resources: dict, cpus: int) -> Node:
        node = Node(name, free_port(), {**resources, f"node_{name}": 1})
        command = [
            sys.executable,
            "-c",
            LOOPBACK_START,
            "start",
            *args,
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(node.resources)}",
            f"--node-manager-port={node.manager_port}",
            f"--object-store-memory={self.object_store_bytes}",
            "--disable-usage-stats",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        env = self.head_env if name == "head" else self.env
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"ray start ({name}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        self.nodes[name] = node
        node.node_id = self._wait_registered(node)
        return node

    def ray_nodes(self) -> list[dict]:
        """ray.nodes() as the cluster's GCS sees it, from a short-lived driver process."""
        # Ray may print its own warnings to this driver's stdout, even after the nodes (a dying
        # node's "raylet has lagging heartbeats"): the nodes are the line behind the marker.
        marker = "ray-nodes-json: "
        code = f"import json, ray; ray.init(logging_level='ERROR'); print({marker!r} + json.dumps(ray.nodes()))"
        done = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
        if not lines:
            raise RuntimeError(f"ray.nodes() printed no node list:\n{done.stdout[-3000:]}")
        return json.loads(lines[-1][len(marker) :])

    def _wait_registered(self, node: Node) -> str:
        deadline = time.time() + 60
        while time.time() < deadline:
            for info in self.ray_nodes():
                if info["Alive"] and info["NodeManagerPort"] == node.manager_port:
                    return info["NodeID"]
            time.sleep(1)
        raise RuntimeError(f"node {node.name} did not register with the head")

    def node_processes(self, node: Node) -> list[psutil.Process]:
        """The node's raylet and everything it started (workers, their vLLM EngineCores, agents),
        and its log monitor."""
        mine = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if self.temp_dir in cmdline and f"--node_manager_port={node.manager_port}" in cmdline:
                mine.append(proc)
        children = [child for proc in mine for child in proc.children(recursive=True)]
        return mine + children

    def kill_node(self, name: str, wait_dead: bool = False) -> int:
        """SIGKILL every process of the node at once, as when a spot instance disappears.
        Returns how many processes were killed. `wait_dead`: return once the GCS has declared
        the node dead (until then it may still place actors there)."""
        node = self.nodes.pop(name)
        killed = _kill(self.node_processes(node))
        deadline = time.time() + 180
        while wait_dead and time.time() < deadline:
            if not any(info["NodeID"] == node.node_id and info["Alive"] for info in self.ray_nodes()):
                break
            time.sleep(2)
        return killed

    def engine_nodes(self) -> list[str]:
        return [name for name, node in self.nodes.items() if "engine_slot" in node.resources]

    def shutdown(self) -> None:
        procs = [p for p in psutil.process_iter(["cmdline"]) if self.temp_dir in " ".join(p.info["cmdline"] or [])]
        _kill(procs + [child for proc in procs for child in proc.children(recursive=True)])
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _kill(procs: list[psutil.Process]) -> int:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    return len(procs)
