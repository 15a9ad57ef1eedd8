"""The JSONL request log (`--log-dir`): one line per request, with the body, usage and outcome.

The log holds prompts, so its file is readable by its owner only; and it never fails a request: a record that
cannot be written is reported once on the server's log and dropped.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("diffgemma.server")

FILE_MODE = 0o600  # owner read/write: the log holds prompts


class RequestLog:
    def __init__(self, log_dir: str | Path) -> None:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path / "requests.jsonl"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:  # an older log made with wider permissions
            os.fchmod(fd, FILE_MODE)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._warned = False

    def write(self, record: dict[str, Any]) -> None:
        """Append one record. ASCII-escaped JSON, so any string a client sent (a lone surrogate included)
        writes; any other failure drops the record, never the request."""
        try:
            line = json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=True, default=str)
            with self._lock:
                if not self._file.closed:
                    self._file.write(line + "\n")
                    self._file.flush()
        except Exception as exc:  # noqa: BLE001 - the log is never why a request fails
            if not self._warned:
                self._warned = True
                log.error(
                    "request log %s: a record could not be written (%s); dropping such records",
                    self.path,
                    exc,
                )

    def close(self) -> None:
        with self._lock:
            self._file.close()
