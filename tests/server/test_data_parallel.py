"""`serve --data-parallel 2` under torchrun on CPU (gloo): two replicas of the bundled model behind one front
address; connections spread over them, each gives the one answer a single server gives."""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from diffgemma.server.balance import Balancer, replica_port
from tests.live_server import stop, wait_up
from tests.server.test_chat import metric

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback (as far as a bind can tell)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_least_connections_with_ties_to_the_lowest_rank():
    b = Balancer([9001, 9002, 9003])
    assert b.pick() == 0
    b.open = [1, 0, 0]
    assert b.pick() == 1
    b.open = [1, 1, 1]
    assert b.pick() == 0
    assert [replica_port(8080, r) for r in range(3)] == [8081, 8082, 8083]


def test_two_replicas_behind_one_front():
    port = _free_ports(3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "diffgemma.cli", "serve",
           "--port", str(port), "--device", "cpu", "--data-parallel", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    front = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, front)
        body = {"model": httpx.get(front + "/v1/models").json()["data"][0]["id"], "prompt": "What is 7 + 5?",
                "max_tokens": 24, "seed": 3, "temperature": 0}  # fmt: skip
        # two clients, each holding its keep-alive connection open: the second goes to the other replica
        with httpx.Client(base_url=front) as a, httpx.Client(base_url=front) as b:
            texts = [
                c.post("/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                for c in (a, b, a)
            ]
        assert texts[0] == texts[1] == texts[2]
        served = [
            metric(SimpleNamespace(base=f"http://127.0.0.1:{replica_port(port, r)}"), "diffgemma_requests_total",
                   route="/v1/completions")
            for r in range(2)
        ]  # fmt: skip
        assert served == [2, 1]
    finally:
        stop(proc)


def test_data_parallel_outside_torchrun_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", "serve", "--port", "0", "--data-parallel", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "torchrun --nproc-per-node 2" in proc.stderr.splitlines()[-1]
