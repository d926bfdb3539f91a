"""Zero-copy batched SET/GET for the redis tier (single server, not cluster).

Why: through plain redis-py a 2 MiB block is copied three times on a store
(joined into one buffer, packed into the command by hiredis, into the
socket) and twice on a load (a fresh ``bytes`` per reply, then into the
row), and fresh multi-MiB buffers fault in new pages on every call.

So, for a batch on one connection borrowed from redis-py's pool (which does
connect, AUTH, TLS, SELECT and pooling):

* **store**: the RESP command is written around the frame -- a small bytes
  object for ``*N $3 SET $k key $len`` + the frame header, then the payload
  buffer itself (for ``codec=none`` a view of the primary row), then the
  tail (``NX``, ``EX ttl``) -- with ``sendall`` per piece: no join, no pack
  copy; redis-py's parser reads the replies.
* **load**: ``GET``/``GETEX`` commands are sent in one write, and each bulk
  reply is read here, off the raw socket, straight into the buffers the core
  planned for it (the frame's header, then the row itself: for ``codec=none``
  the payload lands in the row with ``recv_into``, one kernel copy).

Protocol safety: every reply is consumed to its end (``$len`` bytes + CRLF),
whatever fits in its buffers; any I/O or protocol error, or a reply GET/GETEX
cannot produce, disconnects, so no later command sees a half-read reply.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions as rexc

from kvstore_tiers.backends.base import Buffer, Placed
from kvstore_tiers.errors import ObjectMissing, TransientError, detached

CRLF = b"\r\n"
#: SET value bytes unanswered at once, over all connections (the store window).
SET_WINDOW_BYTES = 8 << 20
#: GETs one connection keeps unanswered at once on a near server (``get_depth`` None),
#: at least: small values get more, up to NEAR_WINDOW_BYTES of them.
GET_DEPTH = 2
#: Bytes of values one connection keeps unanswered on a near server: about what a
#: link of 1 GB/s carries in FAR_S, so the pipeline covers the round trips of any
#: server still counted near, and big values are not built in fresh memory ahead.
NEAR_WINDOW_BYTES = 4 << 20
#: A GET's first reply byte later than this (s) marks the server far: then a batch's
#: window is the connection's share of the bandwidth-delay product (FastIO.window),
#: since each GET held back short of it costs a round trip. Above a
#: switch interval's share of waiting for the GIL on a busy engine, so a near
#: server is not taken for a far one by the time its reader takes to run again.
FAR_S = 0.004
#: The server is far when the least of this many recent first-byte times is: a busy
#: machine only ever adds to one, so the least is the path's own (as TCP's min RTT).
#: Until there are this many, what :func:`ping_rtt` measured at start-up holds: a
#: few first batches queued behind each other on the server say nothing of the path.
FAR_SAMPLES = 16
#: A far server's window is this many times a connection's share of the
#: bandwidth-delay product: room for the next load to run faster when the window was
#: what held the rate it measured back (as TCP BBR's gain), without asking the server
#: for many times what the path carries in a round trip (it builds every reply asked
#: for in fresh memory at once).
BDP_GAIN = 1.5
#: The rate (bytes/s over all connections) a far server's path is taken to carry until
#: a load has measured it: 10 Gbit Ethernet, a prior as TCP's initial window is one.
#: Above what a slower path carries, so the first load asks for more than it needs,
#: not less (each GET held back costs a round trip).
PRIOR_RATE_BPS = 1.25e9
#: A busy period (load batches in flight, with gaps shorter than a round trip between
#: them) measures the path's rate only when it moved at least this many bytes: a small
#: load's time is its round trips, not its bytes over the rate.
RATE_MIN_BYTES = 16 << 20
#: Busy periods whose rates the window takes the most of: the path's, not a load's
#: slowed by a busy machine or by a window too small (as BBR's bandwidth filter).
RATE_SAMPLES = 8


class _ProtocolError(Exception):
    """The reply stream is not what we sent commands for: drop the connection."""


class _Reader:
    """Buffered reads off a socket, with a direct ``recv_into`` for big payloads."""

    __slots__ = ("buf", "end", "mv", "pos", "sock")

    def __init__(self, sock: socket.socket, buf: bytearray) -> None:
        self.sock = sock
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0
        self.end = 0

    def fill(self) -> None:
        """Read what the socket has (at least one byte) into the buffer."""
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):  # move the unread tail to the front
            n = self.end - self.pos
            self.buf[:n] = self.buf[self.pos : self.end]
            self.pos, self.end = 0, n
        got = self.sock.recv_into(self.mv[self.end :])
        if got == 0:
            raise rexc.ConnectionError("connection closed by the server")
        self.end += got

    def readline(self) -> bytes:
        while True:
            i = self.buf.find(CRLF, self.pos, self.end)
            if i >= 0:
                line = bytes(self.buf[self.pos : i])
                self.pos = i + 2
                return line
            if self.end - self.pos >= len(self.buf) - 2:
                raise _ProtocolError("reply line too long")
            self.fill()

    def readinto(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: buffered bytes first, then straight from the socket."""
        n = len(dest)
        have = min(n, self.end - self.pos)
        if have:
            dest[:have] = self.mv[self.pos : self.pos + have]
            self.pos += have
        off = have
        while off < n:
            if n - off < 4096:
                # Small remainder: go through the buffer (fewer tiny recvs).
                self.fill()
                take = min(n - off, self.end - self.pos)
                dest[off : off + take] = self.mv[self.pos : self.pos + take]
                self.pos += take
                off += take
                continue
            got = self.sock.recv_into(dest[off:])
            if got == 0:
                raise rexc.ConnectionError("connection closed by the server")
            off += got

    def skip(self, n: int) -> None:
        while n > 0:
            if self.pos == self.end:
                self.fill()
            take = min(n, self.end - self.pos)
            self.pos += take
            n -= take

    def expect_crlf(self) -> None:
        while self.end - self.pos < 2:
            self.fill()
        if self.buf[self.pos : self.pos + 2] != CRLF:
            raise _ProtocolError("bulk reply not terminated by CRLF")
        self.pos += 2


class FastIO:
    """Batched SET/GET over connections of a redis-py ``ConnectionPool``."""

    def __init__(self, pool: Any, retries: int, backoff: Callable[[int], float],
                 set_window_bytes: int = SET_WINDOW_BYTES, get_depth: int | None = None,
                 rtt_s: float = 0.0) -> None:
        self.pool = pool
        self.retries = retries
        self.backoff = backoff
        self._local = threading.local()
        #: SET value bytes all connections together may have unanswered (0: no limit).
        self.set_window_bytes = set_window_bytes
        self._inflight = 0
        #: GETs unanswered at once per connection; None: by distance (see get_many).
        self.get_depth = get_depth
        #: The path's round trip before any batch has timed one (start-up's PINGs).
        self.rtt_s = rtt_s
        #: The least of the recent batches' first-byte times is over FAR_S (get_depth
        #: None); at first, whether ``rtt_s`` is.
        self.far = rtt_s > FAR_S
        self._first_byte_s: deque[float] = deque(maxlen=FAR_SAMPLES)
        #: Rates (bytes/s, all connections together) of recent busy periods of loads.
        self._rate_Bps: deque[float] = deque(maxlen=RATE_SAMPLES)
        self._busy_lock = threading.Lock()
        self._busy = 0  # batches of GETs in flight now
        self._busy_t0 = self._busy_end = 0.0
        self._busy_bytes = 0
        self._busy_failed = False
        self._window_cv = threading.Condition()

    # -- connection handling ----------------------------------------------------------
    def _with_connection(self, op: Callable[[Any], Any]) -> Any:
        """Run ``op(conn)`` on a pooled connection; reconnect and retry on I/O errors."""
        attempt = 0
        while True:
            conn = self.pool.get_connection()
            try:
                result = op(conn)
            except (rexc.ConnectionError, rexc.TimeoutError, OSError, _ProtocolError) as exc:
                detached(exc)  # its traceback holds the batch's rows: retried or re-raised
                conn.disconnect()  # never reuse a connection in an unknown state
                self.pool.release(conn)
                if attempt >= self.retries or isinstance(exc, _ProtocolError):
                    raise
                attempt += 1
                time.sleep(self.backoff(attempt))
                continue
            except BaseException:
                conn.disconnect()
                self.pool.release(conn)
                raise
            self.pool.release(conn)
            return result

    def _readbuf(self) -> bytearray:
        buf = getattr(self._local, "readbuf", None)
        if buf is None:
            buf = self._local.readbuf = bytearray(1 << 16)
        return buf

    # -- store -------------------------------------------------------------------------
    def set_many(
        self, values: Sequence[tuple[bytes, Sequence[Buffer]]], ttl_s: int | None
    ) -> list[bool | BaseException]:
        """``SET key value NX [EX ttl]`` per ``(key, parts)``, the value being the
        parts back to back.

        Returns per item True (written), False (existed) or the server's error
        (e.g. OutOfMemoryError). Connection errors raise (after retries).

        Pipelined, within the store window: all connections together keep at
        most ``set_window_bytes`` of SET values unanswered (see the module
        docstring); a command waits for the reply of this connection's oldest
        one when the window is full.
        """
        tail = b"\r\n$2\r\nNX\r\n"
        nargs = 4
        if ttl_s:
            t = str(int(ttl_s)).encode()
            tail += b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(t), t)
            nargs = 6
        # Per command: the pieces to write (small parts joined, big payloads as is).
        cmds: list[tuple[list[Any], int]] = []
        for key, parts in values:
            views = [memoryview(p).cast("B") for p in parts]  # lengths in bytes, whatever format
            total = sum(len(v) for v in views)
            pieces: list[Any] = []
            small = bytearray(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                              % (nargs, len(key), key, total))
            for part in views:
                if len(part) < 65536:
                    small += part
                else:  # a big part (a row) goes as it is: no copy
                    pieces += [bytes(small), part]
                    small = bytearray()
            small += tail
            pieces.append(bytes(small))
            cmds.append((pieces, total))

        def op(conn: Any) -> list[bool | BaseException]:
            out: list[bool | BaseException] = []
            pending: list[int] = []  # sizes admitted to the window, replies not yet read
            try:
                def read_one() -> None:
                    try:
                        reply = conn.read_response(disconnect_on_error=True)
                    except rexc.ResponseError as exc:  # -OOM, -READONLY, ...: per command
                        out.append(detached(exc))
                    else:
                        out.append(reply is not None)
                    finally:
                        self._window_release(pending.pop(0))

                for pieces, size in cmds:
                    while not self._window_admit(size, wait=not pending):
                        read_one()
                    pending.append(size)
                    conn.send_packed_command(pieces, check_health=False)
                while pending:
                    read_one()
                return out
            finally:
                if pending:  # an error on the way out: give the window back
                    self._window_release(sum(pending))

        return self._with_connection(op)

    # -- store window ------------------------------------------------------------------
    def _window_admit(self, size: int, wait: bool) -> bool:
        """Take ``size`` bytes of the store window. ``wait=False``: False if it is full.

        A caller with nothing outstanding always gets in eventually (and at
        once when the window is empty, whatever ``size``); a caller with
        replies outstanding never blocks here (it reads a reply instead), so
        connections can never wait on each other in a cycle.
        """
        limit = self.set_window_bytes
        with self._window_cv:
            while limit and self._inflight and self._inflight + size > limit:
                if not wait:
                    return False
                self._window_cv.wait()
            self._inflight += size
            return True

    def _window_release(self, size: int) -> None:
        with self._window_cv:
            self._inflight -= size
            self._window_cv.notify_all()

    # -- load --------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]],
                 ttl_s: int | None) -> list[Placed | BaseException]:
        """GET (GETEX EX ttl) each key, its value's bytes into ``parts[i]`` in order.

        Per key: ``(bytes placed, value size, None)`` (a value longer than its
        parts fills them; the rest is read and dropped), ObjectMissing, or
        TransientError (a server error reply). Connection errors raise.
        """
        if ttl_s:
            t = str(int(ttl_s)).encode()
            cmds = [b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s\r\n$2\r\nEX\r\n$%d\r\n%s\r\n"
                    % (len(k), k, len(t), t) for k in keys]
        else:
            cmds = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys]
        fixed = self.get_depth

        # The window (see window()): on a near server NEAR_WINDOW_BYTES of values,
        # on a far one this connection's share of the bandwidth-delay product, shared
        # by the batches in flight. A load's batches start within a millisecond of
        # each other, so its first ones ask for more than their share until their
        # first reply byte; a load of one batch gets the whole product.
        value = max(1, sum(len(p) for p in parts[0])) if parts else 1
        n = len(cmds)
        tries = 0

        def op(conn: Any) -> list[Placed | BaseException]:
            nonlocal tries
            tries += 1
            depth = max(1, fixed) if fixed else self.window(n, value, self._busy)
            sent = min(depth, n)
            t0 = time.perf_counter()
            conn.send_packed_command([b"".join(cmds[:sent])], check_health=False)
            sock = raw_socket(conn)
            if sock is None:  # redis-py's internals changed under us: drop, retry, fail
                raise _ProtocolError("redis-py connection exposes no socket")
            reader = _Reader(sock, self._readbuf())
            if not fixed:
                reader.fill()  # the first reply byte
                self._first_byte_s.append(time.perf_counter() - t0)
                if len(self._first_byte_s) == FAR_SAMPLES:
                    self.far = min(tuple(self._first_byte_s)) > FAR_S
                depth = self.window(n, value, self._busy)
            out: list[Placed | BaseException] = []
            for i, (key, into) in enumerate(zip(keys, parts, strict=True)):
                if sent < len(cmds) and sent < i + depth:
                    upto = min(len(cmds), i + depth)
                    conn.send_packed_command([b"".join(cmds[sent:upto])], check_health=False)
                    sent = upto
                out.append(self._read_value(reader, key, into))
            if reader.pos != reader.end:
                raise _ProtocolError("unexpected bytes after the last reply")
            return out

        got = -1  # failed or retried: its busy period measures no rate
        self._busy_began()
        try:
            out = self._with_connection(op)
            if tries == 1:  # a retry's time is its backoff's, not the path's
                got = sum(r[1] for r in out if isinstance(r, tuple))
            return out
        finally:
            self._busy_ended(got)

    def window(self, n: int, value: int, sharing: int) -> int:
        """GETs of a batch of ``n`` values of ``value`` bytes one connection keeps
        unanswered (``get_depth`` None), ``sharing`` batches being in flight.

        Near: NEAR_WINDOW_BYTES of values, GET_DEPTH at least. The server copies
        each reply into its output buffers as soon as it reads the GET, so a deeper
        pipeline only makes it fault in fresh memory for replies not read yet.
        Far: BDP_GAIN x the path's bandwidth-delay product (the least of the recent
        first-byte times x the most bytes/s a recent busy period of loads moved,
        PRIOR_RATE_BPS until one has) over the ``sharing`` batches, never less
        than near nor more than ``n``: a GET held back past what the path carries
        in a round trip costs nothing, one held back short of it a round trip.
        Reads snapshots of what other threads append to, so it never waits.
        """
        near = max(GET_DEPTH, NEAR_WINDOW_BYTES // value)
        if not self.far:
            return min(n, near)
        rates = tuple(self._rate_Bps)
        rate = max(rates) if rates else PRIOR_RATE_BPS
        share = BDP_GAIN * self._path_rtt() * rate / max(1, sharing)
        return min(n, max(near, math.ceil(share / value)))

    def _busy_began(self) -> None:
        """A load batch starts. One that starts a round trip or more after the last
        one ended starts a new busy period, and the one before records its rate; a
        shorter gap (a load thread taking its next batch) continues it."""
        with self._busy_lock:
            now = time.perf_counter()
            if self._busy == 0 and now - self._busy_end >= self._path_rtt():
                self._record_rate()
                self._busy_t0, self._busy_bytes, self._busy_failed = now, 0, False
            self._busy += 1

    def _busy_ended(self, got: int) -> None:
        """A load batch is done, ``got`` value bytes read (-1: it failed or was retried,
        and its busy period measures no rate)."""
        with self._busy_lock:
            self._busy -= 1
            self._busy_failed |= got < 0
            self._busy_bytes += max(0, got)
            self._busy_end = time.perf_counter()

    def _record_rate(self) -> None:
        """The rate of the busy period that ended: its bytes over its time less one
        round trip (in which its first GETs travelled and no byte came back), if no
        batch of it failed and it moved RATE_MIN_BYTES at least. Under _busy_lock."""
        took = self._busy_end - self._busy_t0 - self._path_rtt()
        if not self._busy_failed and self._busy_bytes >= RATE_MIN_BYTES and took > 0:
            self._rate_Bps.append(self._busy_bytes / took)

    def _path_rtt(self) -> float:
        """The least of the recent first-byte times; ``rtt_s`` before any batch timed
        one."""
        rtts = tuple(self._first_byte_s)
        return min(rtts) if rtts else self.rtt_s

    @staticmethod
    def _read_value(r: _Reader, key: bytes, parts: Sequence[memoryview]
                    ) -> Placed | BaseException:
        """Read one GET reply into ``parts``, to its end (what does not fit is dropped)."""
        line = r.readline()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return TransientError(f"redis error: {rest.decode(errors='replace')}")
        if kind == b"_":  # RESP3 null (redis-py 8 negotiates RESP3 by default)
            return ObjectMissing(key.decode(errors="replace"))
        if kind != b"$":
            raise _ProtocolError(f"unexpected reply type {kind!r}")
        n = int(rest)
        if n < 0:  # RESP2 null bulk
            return ObjectMissing(key.decode(errors="replace"))
        placed = 0
        for part in parts:  # a raw row's payload lands in the row itself
            take = min(len(part), n - placed)
            if take <= 0:
                break
            r.readinto(part[:take])
            placed += take
        r.skip(n - placed)
        r.expect_crlf()
        return placed, n, None


#: redis-py releases whose connection internals :func:`raw_socket` was written for
#: (pyproject's ``redis`` extra carries the same upper bound).
REDIS_PY_SUPPORTED = ">=5.0,<9"


def ping_rtt(client: Any, pings: int = 3) -> float:
    """The quickest of ``pings`` PINGs, in seconds: the path's round trip, as far as a
    busy machine lets it show (FastIO's ``rtt_s`` until its batches time their own)."""
    took = []
    for _ in range(pings):
        t0 = time.perf_counter()
        client.ping()
        took.append(time.perf_counter() - t0)
    return min(took)


def raw_socket(conn: Any) -> socket.socket | None:
    """The connected socket of a redis-py ``Connection``, or None.

    The one place this package reaches into redis-py's internals, written for
    redis-py 5.x to 8.x (tested against the pinned 8.1 by
    tests/backends/redis/test_fastio_internals.py): a connected
    ``redis.connection.Connection`` (or ``SSLConnection``/
    ``UnixDomainSocketConnection``) keeps its socket in the private attribute
    ``_sock`` (None until ``connect()``), and a pipelined batch leaves nothing
    buffered in redis-py's own parser once every reply was read by us. None
    when the connection is not of that shape (e.g. a client-side-caching proxy
    or a future redis-py), which makes the backend use plain pipelines.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None or not callable(getattr(sock, "recv_into", None)):
        return None
    return sock


def fast_io_supported(client: Any) -> bool:
    """True if ``client`` is a plain (non-cluster) redis-py client we can borrow from.

    Checks, on a real pooled connection, what the fast path relies on
    (``send_packed_command``, ``read_response`` and :func:`raw_socket`), so a
    future redis-py that changes them makes the backend fall back to plain
    pipelines instead of failing every transfer.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None or not hasattr(pool, "get_connection") or not hasattr(pool, "release"):
        return False
    try:
        conn = pool.get_connection()
    except Exception:
        return False
    try:
        if raw_socket(conn) is None:
            conn.connect()
        return (raw_socket(conn) is not None
                and callable(getattr(conn, "send_packed_command", None))
                and callable(getattr(conn, "read_response", None)))
    except Exception:
        return False
    finally:
        pool.release(conn)


__all__ = ["REDIS_PY_SUPPORTED", "FastIO", "fast_io_supported", "raw_socket"]
