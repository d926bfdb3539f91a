"""A loopback TCP proxy in front of redis-server that can answer ``-LOADING`` or reset.

Modes (``mode`` attribute, switched with :meth:`set_mode`):

* ``"pass"`` -- forward bytes both ways;
* ``"loading"`` -- parse the client's RESP commands and answer each with
  ``-LOADING`` (what redis says while it loads its dataset after a restart),
  forwarding nothing;
* ``"reset"`` -- accept and close at once with a TCP RST.

Switching closes every open connection, so pooled clients reconnect and see
the new mode (as they would after a restart).

Independently of the mode, :meth:`stall` holds every reply of the passing
connections (open or new ones) while commands still reach the server -- a
hung or badly delayed server, as the client sees it -- and :meth:`heal` lets
the held replies through, late. Neither closes a connection.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"


class RespProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = "pass"
        self.replies = 0  # -LOADING replies sent
        self.held = 0  # reply chunks held back by stall() (counted once each)
        self._flowing = threading.Event()  # cleared by stall(): replies wait
        self._flowing.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, name="tcpproxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self.mode = mode
            conns, self._conns = self._conns, []
        for c in conns:
            _rst(c)

    def stall(self) -> None:
        """Hold server replies (commands still go through) until :meth:`heal`."""
        self._flowing.clear()

    def heal(self) -> None:
        """Deliver the held replies (late) and forward normally again."""
        self._flowing.set()

    def close(self) -> None:
        self._stop = True
        self.heal()
        self.set_mode("pass")
        self._srv.close()

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._conns.extend(socks)

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            mode = self.mode
            if mode == "reset":
                _rst(c)
                continue
            target = self._loading if mode == "loading" else self._pass
            threading.Thread(target=target, args=(c,), name="tcpproxy-conn", daemon=True).start()

    def _pass(self, c: socket.socket) -> None:
        try:
            u = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _rst(c)
            return
        u.settimeout(None)
        self._track(c, u)
        threading.Thread(target=_pump, args=(u, c, self._hold), name="tcpproxy-pump",
                         daemon=True).start()
        _pump(c, u)

    def _hold(self) -> None:
        """Reply pump: wait here while stalled."""
        if not self._flowing.is_set():
            with self._lock:
                self.held += 1
            self._flowing.wait()

    def _loading(self, c: socket.socket) -> None:
        self._track(c)
        buf = b""
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    return
                buf += data
                while True:
                    n = _command_len(buf)
                    if n is None:
                        break
                    buf = buf[n:]
                    # Counted before it is sent: the client may act on the
                    # reply (and a test read the count) before sendall returns.
                    with self._lock:
                        self.replies += 1
                    c.sendall(LOADING)
        except OSError:
            return


def _command_len(buf: bytes) -> int | None:
    """Length of the first complete RESP array command in ``buf`` (None if incomplete)."""
    if not buf.startswith(b"*"):
        end = buf.find(b"\r\n")  # inline command
        return None if end < 0 else end + 2
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    pos, count = end + 2, int(buf[1:end])
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(buf[pos + 1 : end])
        pos = end + 2 + size + 2
        if pos > len(buf):
            return None
    return pos


def _pump(src: socket.socket, dst: socket.socket,
          before_send: Callable[[], None] | None = None) -> None:
    try:
        while True:
            data = src.recv(262144)
            if not data:
                break
            if before_send is not None:
                before_send()
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()


def _rst(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    except OSError:
        pass
