"""How a fleet test drives a host process (tests/fleet/host.py, engine_host.py): ``go``
and ``stop`` lines on its stdin."""

from __future__ import annotations

import sys
import threading


def wait_for_go() -> threading.Event:
    """Block until stdin says ``go``; return the event set once it says ``stop``
    (or closes)."""
    go, stop = threading.Event(), threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            (go if line.strip() == "go" else stop).set()
        stop.set()

    threading.Thread(target=listen, name="host-stdin", daemon=True).start()
    go.wait()
    return stop
