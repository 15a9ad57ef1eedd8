"""The JSONL request log (`--log-dir`): one line per request, with the body, usage and outcome.

The log holds prompts, so its file is readable by its owner only (and a directory it creates, by its owner only);
and it never fails a request: a record that cannot be written (a full disk, a failing one) is dropped with a
rate-limited warning (`session.journal`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from diffgemma.session.journal import FILE_MODE, JournalFile

log = logging.getLogger("diffgemma.server")

__all__ = ["FILE_MODE", "RequestLog"]


class RequestLog:
    def __init__(self, log_dir: str | Path) -> None:
        self._file = JournalFile(Path(log_dir) / "requests.jsonl", "request log")
        self.path = self._file.path
        self._warned = False

    @property
    def dropped(self) -> int:
        """Records not written (a write failed)."""
        return self._file.dropped

    def write(self, record: dict[str, Any]) -> None:
        """Append one record. ASCII-escaped JSON, so any string a client sent (a lone surrogate included)
        writes; a record that cannot be encoded or written is dropped, never the request."""
        try:
            line = json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=True, default=str)
        except Exception as exc:  # noqa: BLE001 - the log is never why a request fails
            if not self._warned:
                self._warned = True
                log.warning(
                    "request log %s: a record could not be encoded (%s); dropping such records",
                    self.path,
                    exc,
                )
            return
        self._file.write(line)

    def close(self) -> None:
        self._file.close()
