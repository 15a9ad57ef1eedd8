"""A real `diffgemma serve` in a subprocess, for the tests that need one (the page's, data parallel serving's)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, base: str, seconds: float = 120, log: Path | None = None) -> None:
    """Return once `base`/health answers 200; raise with serve's stderr (or the `log` file it writes to) if it
    exits, or after `seconds`."""
    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None:
            raise RuntimeError("serve exited: " + (log.read_text() if log else proc.stderr.read())[-3000:])
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"serve did not come up in {seconds:.0f} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, seconds: float = 20) -> None:
    proc.terminate()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
