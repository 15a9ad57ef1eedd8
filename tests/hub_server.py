"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub 2.4's `model_info(files_metadata=True)`
and `snapshot_download` call, over a dict of files, with the faults the download tests need.

  GET  /api/models/{repo}[/revision/{rev}]     model info; `siblings` with size, blobId and lfs {sha256, size}
  GET  /api/models/{repo}/tree/{rev}           the recursive tree listing (one page)
  HEAD/GET /{repo}/resolve/{rev}/{file}        small files: 200 with ETag (git blob id) and X-Repo-Commit;
                                               LFS files: 302 to the "CDN" with X-Linked-Etag (the sha256)
                                               and X-Linked-Size, as the Hub answers
  HEAD/GET /cdn/{sha256}                       the LFS bytes, with Range (206 Partial Content)

The API is served as `localhost` and the CDN as `127.0.0.1`: two hosts, so huggingface_hub treats the redirect as
one off the Hub, as it does for the real CDN (it stops there and drops the token).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class Seen:
    """One request the server received."""

    method: str
    path: str
    range: str | None


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


class FakeHub:
    """Serves `files` as `repo` at commit COMMIT; files matching `lfs` are LFS files. Faults, set by a test:
    `serve[name] = bytes` serves other bytes while the listing stays the true one; `drop_once[name] = n` sends n
    bytes of the next GET of that file and drops the connection; `down_after_drop` then answers 503 to everything
    until `down` is cleared."""

    def __init__(
        self, files: dict[str, bytes], repo: str = "acme/tiny", lfs: tuple[str, ...] = ("*.safetensors",)
    ):
        self.files = files
        self.repo = repo
        self.lfs = lfs
        self.commit = COMMIT
        self.serve: dict[str, bytes] = {}
        self.drop_once: dict[str, int] = {}
        self.down_after_drop = False
        self.down = False
        self.seen: list[Seen] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://localhost:{self.port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def is_lfs(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.lfs)

    def entry(self, name: str) -> dict:
        """A file's listing, from its true bytes (whatever `serve` says)."""
        data = self.files[name]
        if not self.is_lfs(name):
            return {"size": len(data), "blob_id": git_blob_id(data), "lfs": None}
        pointer = lfs_pointer(data)
        sha = hashlib.sha256(data).hexdigest()
        return {
            "size": len(data),
            "blob_id": git_blob_id(pointer),
            "lfs": {"size": len(data), "sha256": sha, "pointerSize": len(pointer)},
        }

    def gets(self, prefix: str = "/cdn/") -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and s.path.startswith(prefix)]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request a connection: a dropped body is a closed socket

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _send(self, code: int, headers: dict[str, str], data: bytes = b"", body: bool = True) -> None:
            self.send_response(code)
            for k, v in {"Content-Length": str(len(data)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, obj) -> None:
            self._send(200, {"Content-Type": "application/json"}, json.dumps(obj).encode())

        def _answer(self, body: bool) -> None:
            path = urlsplit(self.path).path
            hub.seen.append(Seen(self.command, path, self.headers.get("Range")))
            if hub.down:
                return self._send(503, {"Content-Type": "application/json"}, b'{"error": "down"}', body)
            api = f"/api/models/{hub.repo}"
            resolve = f"/{hub.repo}/resolve/"
            if path in (api, f"{api}/revision/main", f"{api}/revision/{hub.commit}"):
                return self._json({"id": hub.repo, "sha": hub.commit, "siblings": self._siblings()})
            if path in (f"{api}/tree/main", f"{api}/tree/{hub.commit}"):
                return self._json(self._tree())
            if path.startswith(resolve):
                rev, _, name = path[len(resolve) :].partition("/")
                name = unquote(name)
                if rev in ("main", hub.commit) and name in hub.files:
                    return self._resolve(name, body)
            if path.startswith("/cdn/"):
                names = [n for n in hub.files if hub.is_lfs(n) and hub.entry(n)["lfs"]["sha256"] == path[5:]]
                if names:
                    return self._bytes(names[0], {}, body)
            self._send(
                404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": hub.commit}, b"not found", body
            )

        def _siblings(self) -> list[dict]:
            out = []
            for name in hub.files:
                e = hub.entry(name)
                s = {"rfilename": name, "size": e["size"], "blobId": e["blob_id"]}
                if e["lfs"]:
                    s["lfs"] = e["lfs"]
                out.append(s)
            return out

        def _tree(self) -> list[dict]:
            out = []
            for name in hub.files:
                e = hub.entry(name)
                t = {"type": "file", "path": name, "size": e["size"], "oid": e["blob_id"]}
                if e["lfs"]:
                    t["lfs"] = {
                        "oid": e["lfs"]["sha256"],
                        "size": e["size"],
                        "pointerSize": e["lfs"]["pointerSize"],
                    }
                out.append(t)
            return out

        def _resolve(self, name: str, body: bool) -> None:
            e = hub.entry(name)
            headers = {"X-Repo-Commit": hub.commit, "ETag": f'"{e["blob_id"]}"'}
            if e["lfs"] is None:
                return self._bytes(name, headers, body)
            sha = e["lfs"]["sha256"]
            headers |= {
                "Location": f"http://127.0.0.1:{hub.port}/cdn/{sha}",
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(e["size"]),
            }
            self._send(302, headers, b"", body)

        def _bytes(self, name: str, headers: dict[str, str], body: bool) -> None:
            data = hub.serve.get(name, hub.files[name])
            code, start, end = 200, 0, len(data)
            if rng := self.headers.get("Range"):
                first, _, last = rng.removeprefix("bytes=").partition("-")
                start, end = int(first), (int(last) + 1 if last else len(data))
                if start >= len(data):
                    return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"", body)
                code = 206
                headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
            headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            part = data[start:end]
            if (
                body and name in hub.drop_once
            ):  # the full length announced, part of it sent, then the socket closed
                n = hub.drop_once.pop(name)
                self.send_response(code)
                for k, v in {"Content-Length": str(len(part)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(part[:n])
                self.wfile.flush()
                hub.down = hub.down_after_drop
                return
            self._send(code, headers, part, body)

    return Handler


def point_huggingface_hub_at(endpoint: str, monkeypatch) -> None:
    """What HF_ENDPOINT does to huggingface_hub 2.4, which reads it at import time: the endpoint, the resolve-URL
    template, the hosts it trusts with redirects (and the token), and the module-level HfApi's endpoint."""
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_URL_HOSTS", constants.HF_URL_HOSTS | {urlsplit(endpoint).hostname})
    monkeypatch.setattr(_http, "_HUB_ORIGINS", _http._HUB_ORIGINS | {_http._url_origin(endpoint)})
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
