"""A logger wrapper that emits each kind of warning at most once per interval."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedLogger:
    """``warning(kind, msg, *args)`` logs at most once per ``interval_s`` per ``kind``,
    saying how many were suppressed in between. Thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args)
