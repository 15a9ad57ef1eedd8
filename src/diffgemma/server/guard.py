"""The Host and Origin guard: what a web page the user opens could send to the server (DNS rebinding, a
cross-origin request) refused ahead of the routes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diffgemma.server.errors import APIError
from diffgemma.server.metrics import Metrics

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")  # the names every server answers to
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # a bind address that listens on every interface


def host_name(value: str) -> str:
    """The name in a Host header or a host option ("Name:8080", "[::1]:8080", "::1"), lower case, without port,
    brackets or a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # name:port (a bare v6 address has more than one colon)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def served_names(host: str | None, allowed_hosts: Iterable[str]) -> frozenset[str] | None:
    """The Host names a server bound to `host` answers: loopback's, `host` and `allowed_hosts`; None (any) where
    it listens on every interface and no names are given, or `*` is one of them."""
    allowed = [host_name(h) for h in allowed_hosts]
    if "*" in allowed or (not allowed and host is not None and host_name(host) in WILDCARD_HOSTS):
        return None
    names = {*LOOPBACK_NAMES, *allowed}
    if host is not None and host_name(host) not in WILDCARD_HOSTS:
        names.add(host_name(host))
    return frozenset(names)


def _netloc(origin: str) -> str | None:
    """An Origin's host[:port] as a Host header carries it (lower case, no default port); None if not http(s)."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or not rest:
        return None
    rest = rest.rstrip("/")
    default = ":80" if scheme == "http" else ":443"
    return rest.removesuffix(default)


class _GuardMiddleware:
    """Refuses what a web page the user opens could send to this server: a Host it does not serve (DNS rebinding:
    400) and a cross-origin request (an Origin neither this server's own nor listed: 403). Plain ASGI, ahead of the
    routes, so a refused request reaches neither the routes nor the request log."""

    def __init__(
        self, app: Any, names: frozenset[str] | None, origins: frozenset[str], metrics: Metrics
    ) -> None:
        self.app = app
        self.names = names
        self.origins = origins
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        wanted = {b"host": "host", b"origin": "origin"}
        headers = {wanted[k]: v.decode("latin-1") for k, v in scope.get("headers", ()) if k in wanted}
        host = headers.get("host")
        refusal = None
        # no Host at all (HTTP/1.0) is let through: a browser, what this check is about, always sends one
        if self.names is not None and host is not None and host_name(host) not in self.names:
            refusal = APIError(
                400,
                f"the Host {host!r} is not a name this server answers to (serve --allowed-host NAME adds one)",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if refusal is None and origin is not None and not self._allowed(origin, host):
            refusal = APIError(
                403,
                f"a cross-origin request from {origin!r} is refused (serve --allow-origin ORIGIN allows one)",
                code="origin_not_allowed",
            )
        if refusal is None:
            return await self.app(scope, receive, send)
        self.metrics.refused.inc(reason=refusal.code or "")
        await refusal.response()(scope, receive, send)

    def _allowed(self, origin: str, host: str | None) -> bool:
        """Same origin (the Origin's host and port are the Host's; the scheme is not compared, so that a TLS proxy
        in front keeps the page working) or listed."""
        if "*" in self.origins or origin.strip().lower().rstrip("/") in self.origins:
            return True
        netloc = _netloc(origin)
        return netloc is not None and host is not None and netloc == host.strip().lower()
