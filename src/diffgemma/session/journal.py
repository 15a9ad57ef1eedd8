"""An append-only JSONL file that never fails its caller: the op log's and the server's request log's file.

Each record is one `os.write` of a whole line; a write that fails (a full disk, an I/O error) or lands short is
undone (the file truncated back to where the line began, so that the journal stays whole lines) and dropped, with one
warning line on the log when the first record drops and at most one a `WARN_EVERY` seconds after, counting them.
Opening is the one step that raises: a journal that cannot be opened is the caller's to refuse or do without.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path

log = logging.getLogger("diffgemma.journal")

FILE_MODE = 0o600  # owner read/write: journals hold prompts
DIR_MODE = 0o700  # and so does the directory a journal creates
WARN_EVERY = 60.0  # seconds between two warnings about the same journal's dropped records


def open_private(path: Path) -> int:
    """Open `path` to append, created (with its missing directories) readable by its owner only; an older file made
    with wider permissions is narrowed. Raises OSError where the file cannot be opened."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


class JournalFile:
    """`path` open to append whole lines; `write` never raises (see the module's docstring)."""

    def __init__(self, path: str | Path, what: str = "journal") -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = open_private(self.path)
        self._lock = threading.Lock()
        self.dropped = 0  # records lost since the journal opened
        self._unreported = 0  # of them, those no warning has counted yet
        self._warned_at: float | None = None

    def write(self, line: str) -> bool:
        """Append `line` (a newline added); False where it was dropped."""
        data = (line + "\n").encode("utf-8", "backslashreplace")
        with self._lock:
            if self._fd is None:
                return False
            try:
                start = os.fstat(self._fd).st_size
                written = os.write(self._fd, data)
                if written != len(data):
                    self._undo(start, written)
                    raise OSError(errno.ENOSPC, f"short write, {written} of {len(data)} bytes")
            except OSError as exc:
                self._dropped(exc)
                return False
            return True

    def _undo(self, start: int, written: int) -> None:
        """Cut a partly written line off, so that the next line starts a line of its own (only where those bytes
        are still the file's end: another process appending to the same file keeps its lines)."""
        with contextlib.suppress(OSError):  # where it cannot, the partial line stays; the next line is whole
            if os.fstat(self._fd).st_size == start + written:
                os.ftruncate(self._fd, start)

    def _dropped(self, exc: OSError) -> None:
        self.dropped += 1
        self._unreported += 1
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY:
            return
        first = self._warned_at is None
        self._warned_at = now
        log.warning(
            "%s %s: %s could not be written (%s); serving goes on, dropping records%s",
            self.what,
            self.path,
            "a record" if first else f"{self._unreported} records",
            exc.strerror or exc,
            "" if first else f" ({self.dropped} in all)",
        )
        self._unreported = 0

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):  # nothing is buffered: every write went through os.write
                    os.close(fd)
