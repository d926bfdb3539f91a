"""A TCP proxy that puts a round-trip time between a client and a server.

This kernel has no ``netem``, so delay is added in user space. How it works:
every accepted connection gets an upstream connection and two one-way pipes
(client -> server, server -> client). Each pipe is two asyncio tasks joined
by a queue: the *reader* reads whatever bytes have arrived (up to 256 KiB at a
time), stamps them ``arrival + rtt/2`` and queues them at once, then reads
again; the *writer* takes the queue's head, sleeps until its stamp, and
writes it. Bytes leave in the order they came, each exactly ``rtt/2`` after it
arrived (a request and its answer: one ``rtt``), and the reader never waits
for the writer, so the pipe's bandwidth is what the loopback gives: a 100 MB
answer costs one ``rtt`` more, not one per chunk (a sleep per chunk before
forwarding it would serialise them). A pipe holds at most ``window`` bytes
(64 MiB) in flight before its reader pauses, like a TCP window: delayed
bytes are memory. One EOF is forwarded after the delay as a half-close; a
reset closes both sides.

The kernel completes the client's TCP handshake with the proxy at once, so the
proxy stands in for it: a connection's first client bytes wait one more
``rtt`` (``handshake=True``, the default), and every later chunk waits at least
as long as the one before it (order kept). A fresh connection's first answer
then comes two RTTs after ``connect``, as over a real network: the SYN's round
trip, then the request's. TLS's own round trips are not modelled.

Run it as a process (``python -m kvstore_tiers.tools.netem.delay``; it prints
``listening HOST PORT`` on stdout when ready) through :func:`delay_proxy`, so
the proxy's Python never shares a GIL with what it measures. With
``--netns NAME`` the listening socket is made inside that network namespace
(a :class:`kvstore_tiers.tools.netem.link.CappedLink`'s), so a client reaches it
through the capped veth pair; upstream connections leave from the namespace the
process started in (where the server listens on loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Iterator

from kvstore_tiers.tools.children import die_with_parent
from kvstore_tiers.tools.netem import namespaces

READ = 256 << 10
WINDOW = 64 << 20
#: How long a proxy process may take to say it listens (it imports only asyncio).
START_TIMEOUT_S = 30.0


class _Pipe:
    """One direction of one connection: bytes out ``delay`` s after they came in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 delay: float, window: int, first_extra: float = 0.0) -> None:
        self.reader, self.writer, self.delay, self.window = reader, writer, delay, window
        self.extra = first_extra  # added to the first chunk's delay (the handshake)
        self.last_due = 0.0
        self.queue: deque[tuple[float, bytes | None]] = deque()
        self.queued = 0
        self.arrived = asyncio.Event()
        self.drained = asyncio.Event()

    def _due(self) -> float:
        due = max(asyncio.get_running_loop().time() + self.delay + self.extra, self.last_due)
        self.extra, self.last_due = 0.0, due
        return due

    async def pump_in(self) -> None:
        try:
            while True:
                data = await self.reader.read(READ)
                self.queue.append((self._due(), data or None))
                self.arrived.set()
                if not data:
                    return
                self.queued += len(data)
                while self.queued > self.window:
                    self.drained.clear()
                    await self.drained.wait()
        except (ConnectionError, OSError):
            self.queue.append((self._due(), None))
            self.arrived.set()

    async def pump_out(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.arrived.clear()
                await self.arrived.wait()
            due, data = self.queue[0]
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            if data is None:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()
            self.queued -= len(data)
            self.drained.set()


async def _serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                 upstream: tuple[str, int], delay: float, window: int, handshake: bool) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()
        return
    for w in (client_w, server_w):
        sock = w.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pipes = (_Pipe(client_r, server_w, delay, window, 2 * delay if handshake else 0.0),
             _Pipe(server_r, client_w, delay, window))
    tasks = [asyncio.create_task(f()) for p in pipes for f in (p.pump_in, p.pump_out)]
    try:
        await asyncio.gather(*tasks)
    except (ConnectionError, OSError):
        pass
    finally:
        for t in tasks:
            t.cancel()
        for w in (client_w, server_w):
            w.close()


def _listen_in(netns: str | None, host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, made inside network namespace ``netns``
    (None: this one)."""
    with namespaces.inside(netns):
        return socket.create_server((host, port), backlog=512)


async def serve(upstream: tuple[str, int], rtt_s: float, host: str = "127.0.0.1",
                port: int = 0, netns: str | None = None, window: int = WINDOW,
                handshake: bool = True) -> None:
    """Proxy ``host:port`` to ``upstream`` with ``rtt_s`` of round trip until cancelled;
    prints ``listening HOST PORT`` once it accepts."""
    sock = _listen_in(netns, host, port)
    server = await asyncio.start_server(
        lambda r, w: _serve(r, w, upstream, rtt_s / 2, window, handshake), sock=sock)
    print(f"listening {host} {sock.getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def delay_proxy(upstream: tuple[str, int], rtt_ms: float, *, host: str = "127.0.0.1",
                netns: str | None = None, handshake: bool = True
                ) -> Iterator[tuple[str, int]]:
    """A proxy process in front of ``upstream`` adding ``rtt_ms`` per round trip (and one
    more to a connection's first bytes with ``handshake``); yields the ``(host, port)`` to
    connect to and stops the process by its PID (the kernel kills it if this process dies
    first: :mod:`kvstore_tiers.tools.children`)."""
    cmd = [sys.executable, "-m", "kvstore_tiers.tools.netem.delay", "--upstream",
           f"{upstream[0]}:{upstream[1]}", "--rtt-ms", str(rtt_ms), "--listen", host]
    if netns:
        cmd += ["--netns", netns]
    if not handshake:
        cmd.append("--no-handshake")
    # stderr to a file, not a pipe nobody drains while the proxy runs (a full pipe would
    # block it); its start line is waited for with a bound, never read blindly.
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=die_with_parent)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            line = proc.stdout.readline().split() if ready else []
            if len(line) != 3 or line[0] != "listening":
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
                err.seek(0)
                raise RuntimeError(f"delay proxy did not start within {START_TIMEOUT_S:g} s: "
                                   f"{err.read().strip()}")
            yield line[1], int(line[2])
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    ap.add_argument("--rtt-ms", type=float, required=True)
    ap.add_argument("--listen", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--netns", default=None)
    ap.add_argument("--no-handshake", dest="handshake", action="store_false",
                    help="do not delay a connection's first bytes by one more RTT")
    args = ap.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve((host, int(port)), args.rtt_ms / 1e3, args.listen, args.port,
                          args.netns, handshake=args.handshake))


if __name__ == "__main__":
    main()
