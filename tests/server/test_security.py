"""Issue 56 through real HTTP: cross-site requests (Content-Type, Host, Origin, CORS), journals that never fail a
request (a failing or full disk, a read-only directory, 401s kept out), the key behind /openapi.json and from a
file or the environment, and SIGTERM with a long reply in flight (a live `serve` of the demo model)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

from diffgemma.config import ConfigError, env_overrides
from diffgemma.server import create_app
from diffgemma.server.guard import host_name, served_names
from diffgemma.server.run import resolve_api_key
from diffgemma.session import journal
from tests.live_server import free_port, stop, wait_up
from tests.server.conftest import CTX, MODEL, ServerThread

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
CHAT_BODY = {"model": MODEL, "messages": USER, "max_tokens": 4}
COMP_BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
EVIL = "http://evil.example"
APP_ORIGIN = "http://app.example"
ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The OpenAI error body of `r`, checked to be a `status` with `code`."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == code, error
    return error


def journal_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a journal, each parsed (a partial line fails the test)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def metric(text: str, name: str) -> float:
    """A sample's value in a Prometheus exposition (0 where absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- cross-site requests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cors_server(engine, tmp_path_factory) -> Iterator[ServerThread]:
    app = create_app(
        engine, ctx=CTX, log_dir=tmp_path_factory.mktemp("cors-log"), allow_origins=[APP_ORIGIN + "/"]
    )
    with ServerThread(app) as srv:
        yield srv


@pytest.mark.parametrize("route,body", [(CHAT, CHAT_BODY), (COMP, COMP_BODY)])
def test_json_routes_take_only_json(server, route: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    for kind in (
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        r = httpx.post(server.base + route, content=data, headers={"Content-Type": kind}, timeout=30)
        assert repr(kind) in error_of(r, 415, "unsupported_media_type")["message"]
    r = httpx.post(server.base + route, content=data, timeout=30)  # a Blob body: no Content-Type at all
    assert "no Content-Type" in error_of(r, 415, "unsupported_media_type")["message"]
    for kind in (
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/x+json",
    ):
        r = httpx.post(server.base + route, content=data, headers={"Content-Type": kind}, timeout=30)
        assert r.status_code == 200, (kind, r.text)


def test_the_issues_cross_site_post_is_refused(server) -> None:
    """The issue's curl: a foreign Origin and text/plain, answered 200 before; now 403, and the engine never runs."""
    metrics = server.app.state.metrics
    log_path = server.app.state.request_log_path
    before_lines = len(log_path.read_text().splitlines())
    before_refused = metrics.refused.value(reason="origin_not_allowed")
    data = json.dumps(CHAT_BODY).encode()
    for kind in ("text/plain", "application/json"):
        r = httpx.post(server.base + CHAT, content=data, headers={"Origin": EVIL, "Content-Type": kind})
        assert EVIL in error_of(r, 403, "origin_not_allowed")["message"]
        assert "access-control-allow-origin" not in r.headers
    error_of(httpx.get(server.base + "/v1/models", headers={"Origin": EVIL}), 403, "origin_not_allowed")
    error_of(httpx.options(server.base + CHAT, headers={"Origin": EVIL}), 403, "origin_not_allowed")
    assert metrics.refused.value(reason="origin_not_allowed") == before_refused + 4
    assert (
        len(log_path.read_text().splitlines()) == before_lines
    )  # refused before the routes and their journal
    # another port of this machine is another origin (a dev server, say)
    other = f"http://127.0.0.1:{server.port + 1}"
    error_of(
        httpx.post(server.base + CHAT, json=CHAT_BODY, headers={"Origin": other}), 403, "origin_not_allowed"
    )
    # a sandboxed frame or a file:// page sends Origin: null
    error_of(
        httpx.post(server.base + CHAT, json=CHAT_BODY, headers={"Origin": "null"}), 403, "origin_not_allowed"
    )


def test_a_foreign_host_is_refused(server) -> None:
    port = server.port
    for host in ("evil.example", f"evil.example:{port}", "EVIL.example.", f"127.0.0.2:{port}"):
        r = httpx.post(server.base + CHAT, json=CHAT_BODY, headers={"Host": host})
        assert host in error_of(r, 400, "host_not_allowed")["message"]
        error_of(httpx.get(server.base + "/health", headers={"Host": host}), 400, "host_not_allowed")
    # DNS rebinding: evil.example resolves to 127.0.0.1, so the page's requests are "same origin" to the browser
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    error_of(httpx.post(server.base + CHAT, json=CHAT_BODY, headers=rebound), 400, "host_not_allowed")
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        f"localhost:{port}",
        "LocalHost",
        f"[::1]:{port}",
        "[::1]",
    ):
        assert httpx.get(server.base + "/health", headers={"Host": host}).status_code == 200, host


def test_the_servers_own_origin_is_allowed(server) -> None:
    """What the page at / sends: its own origin, from whichever loopback name it was opened at."""
    port = server.port
    for name in ("127.0.0.1", "localhost"):
        headers = {"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}"}
        r = httpx.post(server.base + CHAT, json=CHAT_BODY, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert "access-control-allow-origin" not in r.headers  # same origin needs no CORS
        page = httpx.get(server.base + "/", headers=headers)
        assert page.status_code == 200 and "<html" in page.text.lower()


def test_an_allowed_origin_gets_cors(cors_server) -> None:
    base = cors_server.base
    preflight = {
        "Origin": APP_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(base + CHAT, headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {
        h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")
    }
    r = httpx.post(base + CHAT, json=CHAT_BODY, headers={"Origin": APP_ORIGIN}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "origin" in r.headers["vary"].lower()
    # its errors too, so that its page can read them
    r = httpx.post(base + CHAT, content=b"{}", headers={"Origin": APP_ORIGIN, "Content-Type": "text/plain"})
    error_of(r, 415, "unsupported_media_type")
    assert r.headers["access-control-allow-origin"] == APP_ORIGIN
    # the others still refused, preflight and all
    r = httpx.options(base + CHAT, headers={**preflight, "Origin": EVIL})
    error_of(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    error_of(httpx.post(base + CHAT, json=CHAT_BODY, headers={"Origin": EVIL}), 403, "origin_not_allowed")


def test_any_origin(engine) -> None:
    with ServerThread(create_app(engine, ctx=CTX, allow_origins=["*"])) as srv:
        r = httpx.post(srv.base + CHAT, json=CHAT_BODY, headers={"Origin": EVIL}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        # the Host check stands: a listed origin is no licence for a rebound name
        error_of(httpx.get(srv.base + "/health", headers={"Host": "evil.example"}), 400, "host_not_allowed")


def test_hosts_a_server_answers_to(engine) -> None:
    assert served_names("127.0.0.1", ()) == {"127.0.0.1", "localhost", "::1"}
    assert served_names("10.1.2.3", ["Box.Lan"]) == {"127.0.0.1", "localhost", "::1", "10.1.2.3", "box.lan"}
    assert served_names("[::1]", ()) == {"127.0.0.1", "localhost", "::1"}
    # every interface and no names given: any Host (the names it is reached by are not its to know)
    assert served_names("0.0.0.0", ()) is None and served_names("::", ()) is None
    assert served_names("0.0.0.0", ["box.lan"]) == {"127.0.0.1", "localhost", "::1", "box.lan"}
    assert served_names("127.0.0.1", ["*"]) is None
    assert [host_name(h) for h in ("A.b:80", "[::1]:8080", "::1", "x.", "[fe80::1]")] == [
        "a.b", "::1", "::1", "x", "fe80::1"
    ]  # fmt: skip
    with ServerThread(create_app(engine, ctx=CTX, host="0.0.0.0")) as srv:
        assert httpx.get(srv.base + "/health", headers={"Host": "evil.example"}).status_code == 200
        own = {"Host": "box.lan:8080", "Origin": "http://box.lan:8080"}
        assert httpx.post(srv.base + CHAT, json=CHAT_BODY, headers=own, timeout=30).status_code == 200
        # still no foreign page
        r = httpx.post(srv.base + CHAT, json=CHAT_BODY, headers={"Host": "box.lan:8080", "Origin": EVIL})
        error_of(r, 403, "origin_not_allowed")
    with ServerThread(create_app(engine, ctx=CTX, host="127.0.0.1", allowed_hosts=["box.lan"])) as srv:
        assert httpx.get(srv.base + "/health", headers={"Host": "box.lan:8080"}).status_code == 200
        error_of(httpx.get(srv.base + "/health", headers={"Host": "evil.example"}), 400, "host_not_allowed")


# --- the key -----------------------------------------------------------------------------------------------------


def test_unauthorized_requests_are_counted_not_journalled(engine, tmp_path) -> None:
    log_dir = tmp_path / "log"
    with ServerThread(create_app(engine, ctx=CTX, api_key="k", log_dir=log_dir)) as srv:
        for i in range(8):
            headers = {"Authorization": "Bearer wrong"} if i % 2 else {}
            r = httpx.post(srv.base + CHAT, json=CHAT_BODY, headers=headers)
            error_of(r, 401, "invalid_api_key")
        error_of(httpx.get(srv.base + "/v1/models"), 401, "invalid_api_key")
        key = {"Authorization": "Bearer k"}
        assert httpx.post(srv.base + CHAT, json=CHAT_BODY, headers=key, timeout=30).status_code == 200
        text = httpx.get(srv.base + "/metrics", headers=key).text
    assert metric(text, 'diffgemma_unauthorized_requests_total{route="/v1/chat/completions"}') == 8
    assert metric(text, 'diffgemma_unauthorized_requests_total{route="/v1/models"}') == 1
    lines = journal_lines(log_dir / "requests.jsonl")
    assert [line["status"] for line in lines] == [200]  # the keyed one alone


def test_openapi_is_behind_the_key(engine, server) -> None:
    with ServerThread(create_app(engine, ctx=CTX, api_key="k")) as srv:
        r = httpx.get(srv.base + "/openapi.json")
        error_of(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(srv.base + "/docs").status_code == 404  # no docs page to leak it either
        spec = httpx.get(srv.base + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert CHAT in spec["paths"] and "/openapi.json" not in spec["paths"]
    assert CHAT in httpx.get(server.base + "/openapi.json").json()["paths"]  # no key, no lock


def test_the_key_from_a_file_or_the_environment(tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    key_file.chmod(0o600)
    env = {"DIFFGEMMA_API_KEY": "env-key"}
    assert resolve_api_key(None, key_file, env) == "file-key"
    assert resolve_api_key(None, None, env) == "env-key"
    assert resolve_api_key("flag-key", None, env) == "flag-key"  # the command line wins
    assert resolve_api_key(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("a", key_file, {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, tmp_path / "empty", {})
    with pytest.raises(ConfigError, match="DIFFGEMMA_API_KEY is set but empty"):
        resolve_api_key(None, None, {"DIFFGEMMA_API_KEY": " "})
    with pytest.raises(FileNotFoundError):
        resolve_api_key(None, tmp_path / "missing", {})
    # a known name to the config's environment check, which refuses unknown DIFFGEMMA_* names
    assert env_overrides("runtime", {"DIFFGEMMA_API_KEY": "x"}) == {}
    with pytest.raises(ConfigError, match="DIFFGEMMA_API_KEY"):  # and listed among the known ones
        env_overrides("runtime", {"DIFFGEMMA_API_KEYS": "x"})


# --- the journals ------------------------------------------------------------------------------------------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "diffgemma.journal" and r.levelno >= logging.WARNING
    ]


def test_the_log_dir_is_private(engine, tmp_path) -> None:
    log_dir = tmp_path / "fresh" / "logs"
    with ServerThread(create_app(engine, ctx=CTX, log_dir=log_dir)) as srv:
        assert httpx.post(srv.base + CHAT, json=CHAT_BODY, timeout=30).status_code == 200
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    for name in ("requests.jsonl", "ops.jsonl"):
        assert stat.S_IMODE((log_dir / name).stat().st_mode) == 0o600, name
        assert journal_lines(log_dir / name)


class FailingWrites(SimpleNamespace):
    """The os module as the journal sees it, but for `write`: ENOSPC while `full`."""

    def __init__(self) -> None:
        super().__init__(full=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


def test_failing_journal_writes_never_fail_a_request(engine, tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="diffgemma.journal")
    log_dir = tmp_path / "log"
    with ServerThread(create_app(engine, ctx=CTX, log_dir=log_dir)) as srv:
        sizes = {p.name: p.stat().st_size for p in log_dir.iterdir()}
        failing = FailingWrites()
        monkeypatch.setattr(journal, "os", failing)
        statuses = [httpx.post(srv.base + CHAT, json=CHAT_BODY, timeout=30).status_code for _ in range(5)]
        statuses += [httpx.post(srv.base + COMP, json=COMP_BODY, timeout=30).status_code for _ in range(3)]
        srv.check_registry()
        assert statuses == [200] * 8
        warned = warnings_of(caplog)
        assert len(warned) == 2, warned  # one line each journal, not one a record
        assert any("request log" in w and "requests.jsonl" in w for w in warned)
        assert any("op log" in w and "ops.jsonl" in w for w in warned)
        assert all("No space left on device" in w for w in warned)
        assert {p.name: p.stat().st_size for p in log_dir.iterdir()} == sizes  # nothing half-written
        failing.full = False  # the disk has room again: records are written again
        assert httpx.post(srv.base + CHAT, json=CHAT_BODY, timeout=30).status_code == 200
        srv.check_registry()
    assert journal_lines(log_dir / "requests.jsonl")[-1]["status"] == 200
    assert any("op" in line for line in journal_lines(log_dir / "ops.jsonl"))


def test_journal_short_writes_are_undone_and_warnings_rate_limited(tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="diffgemma.journal")
    now = [1000.0]
    monkeypatch.setattr(journal, "time", SimpleNamespace(monotonic=lambda: now[0]))
    j = journal.JournalFile(tmp_path / "j.jsonl", "test journal")
    assert j.write('{"a": 1}')
    half = FailingWrites()
    half.write = lambda fd, data: os.write(fd, data[: len(data) // 2])  # a disk that fills mid-line
    monkeypatch.setattr(journal, "os", half)
    for _ in range(5):
        assert not j.write('{"b": 2, "padding": "' + "x" * 100 + '"}')
        now[0] += 10
    assert (tmp_path / "j.jsonl").read_text() == '{"a": 1}\n'  # each partial line cut off again
    assert len(warnings_of(caplog)) == 1 and "short write" in warnings_of(caplog)[0]
    now[0] += journal.WARN_EVERY
    assert not j.write("{}")
    warned = warnings_of(caplog)
    assert len(warned) == 2 and "6 records" not in warned[1] and "5 records" in warned[1], warned
    monkeypatch.setattr(journal, "os", os)
    assert j.write('{"c": 3}') and j.dropped == 6
    j.close()
    assert not j.write("{}")  # after close: dropped quietly, no raise
    assert journal_lines(tmp_path / "j.jsonl") == [{"a": 1}, {"c": 3}]


def test_an_unusable_log_dir_at_start_is_a_warning(engine, tmp_path, caplog) -> None:
    """A log dir that cannot be made (its parent a file): the server starts, warns, serves without journals."""
    caplog.set_level(logging.WARNING)
    (tmp_path / "file").write_text("")
    app = create_app(engine, ctx=CTX, log_dir=tmp_path / "file" / "logs")
    assert app.state.request_log_path is None and app.state.op_log_path is None
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "op log" in text and "request log" in text and "serving without it" in text
    with ServerThread(app) as srv:
        assert httpx.post(srv.base + CHAT, json=CHAT_BODY, timeout=30).status_code == 200


def mount_tmpfs(path: Path, options: str) -> None:
    """Mount a tmpfs at `path` (skip the test where this machine does not let us: not root, no mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fill the file system under `path` to the last byte; the filler's path."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 1024)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with pytest.raises(OSError):
        (path / "probe").write_bytes(b"x" * 4096)
    return filler


def test_a_read_only_log_dir_at_start(engine, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    mount_tmpfs(tmp_path / "ro", "ro,size=64k")
    try:
        app = create_app(engine, ctx=CTX, log_dir=tmp_path / "ro" / "logs")
        text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert "Read-only file system" in text and "serving without it" in text
        with ServerThread(app) as srv:
            assert httpx.post(srv.base + CHAT, json=CHAT_BODY, timeout=30).status_code == 200
    finally:
        unmount(tmp_path / "ro")


# --- a live serve -------------------------------------------------------------------------------------------------


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`diffgemma serve` of the bundled demo model on a free port, up; (the process, its base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "diffgemma.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
    except BaseException:
        stop(proc, 5)
        raise
    return proc, base


def test_serve_full_log_disk_and_key_file(tmp_path) -> None:
    """serve with its key in a file, its log dir on a tmpfs that then fills: every request 200, one warning line
    a journal on stderr; the key is nowhere in the process list."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "size=64k")
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    key_file.chmod(0o600)
    proc = None
    try:
        proc, base = serve("--api-key-file", str(key_file), "--log-dir", str(disk / "logs"))
        assert b"file-key" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        key = {"Authorization": "Bearer file-key"}
        error_of(httpx.get(base + "/openapi.json"), 401, "invalid_api_key")
        assert CHAT in httpx.get(base + "/openapi.json", headers=key).json()["paths"]
        body = {"messages": USER, "max_tokens": 8}
        assert httpx.post(base + CHAT, json=body, headers=key, timeout=60).status_code == 200
        assert stat.S_IMODE((disk / "logs").stat().st_mode) == 0o700
        filler = fill(disk)
        # a full file system still takes appends into its files' last pages: enough records to overflow them
        padded = {**body, "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 300}]}
        statuses = [
            httpx.post(base + CHAT, json={**padded, "user": f"full-{i}"}, headers=key, timeout=60).status_code
            for i in range(12)
        ]
        assert statuses == [200] * 12
        filler.unlink()
        after = {**body, "user": "after"}
        assert httpx.post(base + CHAT, json=after, headers=key, timeout=60).status_code == 200
        lines = journal_lines(disk / "logs" / "requests.jsonl")  # whole lines only, each parses
        users = [line["request"].get("user") for line in lines]
        assert users[0] is None and users[-1] == "after" and len(users) < 14, users  # some records dropped
        assert journal_lines(disk / "logs" / "ops.jsonl")
    finally:
        if proc is not None:
            stop(proc, 20)
            err = proc.stderr.read()
        unmount(disk)
    assert proc.returncode == 0, err[-3000:]
    failed = [line for line in err.splitlines() if "could not be written" in line]
    assert len(failed) == 2, failed  # one a journal
    assert "request log" in failed[0] + failed[1] and "op log" in failed[0] + failed[1]
    assert "Traceback" not in err, err[-3000:]


def test_serve_sigterm_ends_a_long_reply_after_the_grace(tmp_path) -> None:
    """A streaming reply that would run for minutes: SIGTERM lets it run the grace, then cancels it cleanly (its
    last chunk says "cancelled", then [DONE]); the process exits 0 within the grace and a few seconds. The key comes
    from DIFFGEMMA_API_KEY."""
    grace = 3.0
    # neither a stop token nor a block of pad can end the demo's reply early: it runs to max_tokens
    env = {"DIFFGEMMA_API_KEY": "env-key", "DIFFGEMMA_STOP_TOKEN_IDS": "3", "DIFFGEMMA_PAD_BLOCK_STOP": "0"}
    proc, base = serve("--shutdown-grace", str(grace), env=env)
    try:
        assert b"env-key" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        error_of(httpx.get(base + "/v1/models"), 401, "invalid_api_key")
        key = {"Authorization": "Bearer env-key"}
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 6000,
            "stream": True,
        }
        events: list[tuple[float, str]] = []
        started = threading.Event()

        def read() -> None:
            with httpx.stream("POST", base + CHAT, json=body, headers=key, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append((time.monotonic(), line[6:]))
                        started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(60), "the reply did not start"
        time.sleep(1.0)
        term = time.monotonic()
        proc.send_signal(15)
        rc = proc.wait(grace + 15)
        took = time.monotonic() - term
        reader.join(10)
    finally:
        stop(proc, 5)
    err = proc.stderr.read()
    assert rc == 0, err[-3000:]
    assert took < grace + 6, f"exited {took:.1f} s after SIGTERM (grace {grace} s)"
    assert took >= grace - 0.5, f"exited {took:.1f} s after SIGTERM, before the grace was up"
    assert events and events[-1][1] == "[DONE]", events[-3:]
    last = json.loads(events[-2][1])
    assert last["choices"][0]["finish_reason"] == "cancelled", last
    assert "replies still running after the 3 s grace; cancelling them" in err
    assert "Traceback" not in err, err[-3000:]
