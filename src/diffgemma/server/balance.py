"""Data parallel serving's front: one address for N replicas (`serve --data-parallel N` under torchrun, a replica a
process and GPU, each a whole server on a loopback port of its own). Each client connection is piped, byte for
byte, to the replica with the fewest open connections (the lowest rank among equals): HTTP, keep-alive and
server-sent events pass through untouched, and a connection's requests, with their conversations' KV, stay on one
replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

log = logging.getLogger("diffgemma.server")

CONNECT_TRIES = 50  # a replica still starting refuses connections: retried every CONNECT_WAIT_S
CONNECT_WAIT_S = 0.2
CHUNK = 1 << 16


def replica_port(port: int, rank: int) -> int:
    """The loopback port replica `rank` listens on behind the front's `port`."""
    return port + 1 + rank


class Balancer:
    """Least-connections TCP front over replicas at 127.0.0.1:ports[i]; `open[i]` counts their connections."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.open = [0] * len(ports)

    def pick(self) -> int:
        return min(range(len(self.ports)), key=lambda i: (self.open[i], i))

    async def _connect(self, i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        for _ in range(CONNECT_TRIES - 1):
            try:
                return await asyncio.open_connection("127.0.0.1", self.ports[i])
            except OSError:
                await asyncio.sleep(CONNECT_WAIT_S)
        return await asyncio.open_connection("127.0.0.1", self.ports[i])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = self.pick()
        self.open[i] += 1
        try:
            up_reader, up_writer = await self._connect(i)
        except OSError as e:
            log.warning("replica %d (port %d) unreachable: %s", i, self.ports[i], e)
            self.open[i] -= 1
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self.open[i] -= 1
            for w in (writer, up_writer):
                w.close()

    async def serve(self, host: str, port: int, ready: threading.Event | None = None) -> None:
        server = await asyncio.start_server(self.handle, host, port)
        if ready is not None:
            ready.set()
        async with server:
            await server.serve_forever()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy src to dst until src ends, then end dst's side of the stream."""
    with contextlib.suppress(ConnectionError, OSError):  # either side gone: the connection is over
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
    with contextlib.suppress(ConnectionError, OSError):
        if dst.can_write_eof():
            dst.write_eof()


def start_in_thread(host: str, port: int, ports: list[int]) -> threading.Thread:
    """The front in a daemon thread of its own (its own event loop); returns once it listens, or raises why not."""
    ready = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(Balancer(ports).serve(host, port, ready))
        except BaseException as e:  # noqa: BLE001 - the address taken, say: told to the caller, not lost
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=run, name="diffgemma-front", daemon=True)
    thread.start()
    ready.wait()
    if failed:
        raise RuntimeError(f"the data parallel front cannot listen on {host}:{port}: {failed[0]}")
    return thread
