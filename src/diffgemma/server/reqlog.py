"""The JSONL request log (`--log-dir`): one line per request, with the body, usage and outcome."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class RequestLog:
    def __init__(self, log_dir: str | Path) -> None:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "requests.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed with the app
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=False, default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
