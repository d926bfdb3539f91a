"""The delaying proxy and the capped link of kvstore_tiers.tools.netem: each direction's
bytes arrive RTT/2 after they were sent, in order, without a delay per chunk; a
fresh connection's first bytes pay the handshake's RTT; a CappedLink caps bandwidth."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore_tiers.tools.netem import link
from kvstore_tiers.tools.netem.delay import delay_proxy
from tests.netns import require_netns
from tests.orphans import children_die_with_parent

RTT_MS = 200
#: Scheduling slack on a busy 2-core machine (a CI run's other tests, the proxy's own
#: process): a delay may be this much late, never early. Still well below what a wrong
#: proxy costs: one more half RTT (0.1 s) per chunk, 4 s for the burst test's 40.
LATE_S = 0.25


class Peer:
    """A loopback server that records when each byte arrived and can send on demand."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.conn: socket.socket | None = None
        self.ready = threading.Event()
        self.received: list[tuple[float, bytes]] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.conn, _ = self.srv.accept()
        self.ready.set()
        while data := self.conn.recv(1 << 20):
            self.received.append((time.monotonic(), data))

    def got(self, n: int, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while sum(len(d) for _, d in self.received) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        return b"".join(d for _, d in self.received)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.srv.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed early"
        buf += chunk
    return bytes(buf)


def test_each_direction_takes_half_the_rtt_and_the_first_bytes_the_handshake(peer: Peer
                                                                            ) -> None:
    with delay_proxy(("127.0.0.1", peer.port), RTT_MS) as addr:
        c = socket.create_connection(addr)
        t0 = time.monotonic()
        c.sendall(b"hello")
        assert peer.got(5) == b"hello"
        first = peer.received[0][0] - t0  # handshake RTT + RTT/2
        assert 1.5 * RTT_MS / 1e3 <= first < 1.5 * RTT_MS / 1e3 + LATE_S
        # Client -> server on the open connection: RTT/2.
        t0 = time.monotonic()
        c.sendall(b"again")
        assert peer.got(10) == b"helloagain"
        up = peer.received[-1][0] - t0
        assert RTT_MS / 2e3 <= up < RTT_MS / 2e3 + LATE_S
        # Server -> client: RTT/2 too.
        assert peer.ready.wait(5) and peer.conn is not None
        t0 = time.monotonic()
        peer.conn.sendall(b"back")
        assert _recv_exactly(c, 4) == b"back"
        down = time.monotonic() - t0
        assert RTT_MS / 2e3 <= down < RTT_MS / 2e3 + LATE_S
        c.close()


def test_without_handshake_the_first_bytes_take_half_the_rtt(peer: Peer) -> None:
    with delay_proxy(("127.0.0.1", peer.port), RTT_MS, handshake=False) as addr:
        c = socket.create_connection(addr)
        t0 = time.monotonic()
        c.sendall(b"x")
        assert peer.got(1) == b"x"
        assert RTT_MS / 2e3 <= peer.received[0][0] - t0 < RTT_MS / 2e3 + LATE_S
        c.close()


def test_order_is_kept_and_chunks_are_not_delayed_one_by_one(peer: Peer) -> None:
    """40 sends in a burst, each its own chunk: all arrive in order about RTT/2 after the
    first was sent; a sleep per chunk would take 40 x RTT/2."""
    parts = [bytes([i]) * (64 << 10) for i in range(40)]
    with delay_proxy(("127.0.0.1", peer.port), RTT_MS, handshake=False) as addr:
        c = socket.create_connection(addr)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        for p in parts:
            c.sendall(p)
            time.sleep(0.001)
        total = sum(len(p) for p in parts)
        assert peer.got(total) == b"".join(parts)
        last = peer.received[-1][0] - t0
        assert last < RTT_MS / 2e3 + 0.04 * 2 + LATE_S * 2  # sends span ~40 ms
        # ... and the reverse direction keeps order as well.
        assert peer.ready.wait(5) and peer.conn is not None
        for p in parts:
            peer.conn.sendall(p)
        assert _recv_exactly(c, total) == b"".join(parts)
        c.close()


def test_an_eof_is_forwarded_after_the_delay(peer: Peer) -> None:
    with delay_proxy(("127.0.0.1", peer.port), RTT_MS, handshake=False) as addr:
        c = socket.create_connection(addr)
        c.sendall(b"bye")
        c.shutdown(socket.SHUT_WR)
        assert peer.got(3) == b"bye"
        assert peer.ready.wait(5) and peer.conn is not None
        peer.conn.sendall(b"ok")
        assert _recv_exactly(c, 2) == b"ok"  # a half-close leaves the other way open
        c.close()


def test_a_capped_link_caps_bandwidth(peer: Peer) -> None:
    """8 MB through a 100 Mbit/s link take at least 0.6 s (0.67 s at the rate, TBF's
    10 ms burst aside); through loopback they take a few ms."""
    require_netns()
    body = b"z" * (8 << 20)
    with link.CappedLink(100) as capped, delay_proxy(
            ("127.0.0.1", peer.port), 0, host=capped.inner, netns=capped.netns) as addr:
        assert addr[0] == capped.inner
        c = socket.create_connection(addr)
        t0 = time.monotonic()
        c.sendall(body)
        assert peer.got(len(body), timeout=30) == body
        took = peer.received[-1][0] - t0
        c.close()
    assert took >= 0.6, took
    assert capped.netns not in link.subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_proxy_dies_with_the_process_that_started_it(peer: Peer) -> None:
    """A test process killed by SIGKILL runs no ``finally``: the kernel kills its proxy."""
    _, children = children_die_with_parent(
        "from kvstore_tiers.tools.netem.delay import delay_proxy\n"
        f"proxy = delay_proxy(('127.0.0.1', {peer.port}), 5)\n"
        "proxy.__enter__()\n")
    assert len(children) == 1
