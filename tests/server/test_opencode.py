"""opencode (`npm install -g opencode-ai`) against `diffgemma serve` on the bundled demo model, with the README's
provider config: its system prompt alone is more than the demo's 8,192 positions, so whatever its compaction
setting it must end with the context error, not compact and retry until its timeout. Skipped where `opencode` is
not on PATH (or named by OPENCODE_BIN)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import free_port, stop, wait_up

OPENCODE = os.environ.get("OPENCODE_BIN") or shutil.which("opencode")
pytestmark = pytest.mark.skipif(OPENCODE is None, reason="needs opencode (npm install -g opencode-ai)")
LIMIT = 150  # seconds: before the fix, compaction on retried until opencode's own timeout


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """serve's base URL and its log directory (requests.jsonl)."""
    port, logs = free_port(), tmp_path_factory.mktemp("log")
    cmd = [sys.executable, "-m", "diffgemma.cli", "serve", "--port", str(port), "--log-dir", str(logs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        yield base, logs
    finally:
        stop(proc, 10)


@pytest.mark.parametrize("auto", [False, True])
def test_opencode_ends_with_the_context_error(served, tmp_path, auto) -> None:
    base, logs = served
    config = {
        "provider": {
            "diffgemma": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "diffgemma (local)",
                "options": {"baseURL": base + "/v1", "apiKey": "unused"},
                "models": {"demo": {"name": "demo"}},  # the id `serve` reports for the demo model
            }
        },
        "compaction": {"auto": auto},
    }
    home = tmp_path / "home"  # opencode's own state, config and caches, away from the user's
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
    }
    (home / "proj").mkdir(parents=True)
    before = (
        len((logs / "requests.jsonl").read_text().splitlines()) if (logs / "requests.jsonl").exists() else 0
    )
    t0 = time.monotonic()
    run = subprocess.run(
        [OPENCODE, "run", "-m", "diffgemma/demo", "What is 17 + 25?"],
        cwd=home / "proj",
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    took = time.monotonic() - t0
    assert run.returncode != 0 and took < LIMIT
    assert "this server's context is 8192 tokens" in run.stdout + run.stderr
    records = [json.loads(line) for line in (logs / "requests.jsonl").read_text().splitlines()[before:]]
    # every request was refused at once: none streamed to its end
    assert records and all(r["status"] == 400 for r in records)
    assert any("max_tokens is 32000" in r["error"] for r in records)  # the title (and compaction) request
