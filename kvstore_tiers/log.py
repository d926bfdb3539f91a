"""Make our log lines appear where vLLM's do, and keep their writing off vLLM's scheduler thread.

vLLM configures handlers on its own ``vllm`` logger only, so records of the
``kvstore_tiers`` logger would reach nobody below WARNING. When vLLM's
logger has handlers and ours has none, ours borrows them. When vLLM has not
configured logging yet (its plugins load before that in some processes), ours
gets a stderr handler in vLLM's format, so lines such as the "'fs' now means"
notice are not lost. ``VLLM_CONFIGURE_LOGGING=0`` means the application
configures logging itself: then we add nothing.

:class:`SchedulerLogger` is the logger of code on vLLM's scheduler thread
(the tier's methods, its ledger and breaker): writing a record takes each
handler's lock and writes its stream, so another thread logging at that
moment (an I/O thread reporting a dead node) or a stream that blocks (a full
pipe to a slow log collector) would hold the scheduler. Its records go on a
queue instead, and a thread of its own hands them to the real logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from queue import SimpleQueue

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as
    ``logging.lastResort`` does), so a replaced stderr (a CLI test runner, a
    daemonised process) never leaves us writing to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def attach_to_vllm_logging() -> None:
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    ours = logging.getLogger("kvstore_tiers")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level or logging.INFO)
        ours.propagate = vllm_logger.propagate  # as vLLM's own records do
    else:
        # Records still propagate: an application's root handlers see them too.
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def log_to_stderr(level: int = logging.WARNING) -> None:
    """For a command-line tool: our records at ``level`` and above on stderr in vLLM's
    format, and nothing of ours below it (the tiers' start-up and shutdown lines).
    Call before vLLM loads our plugin: :func:`attach_to_vllm_logging` then leaves ours as is."""
    ours = logging.getLogger("kvstore_tiers")
    if not any(isinstance(h, _CurrentStderrHandler) for h in ours.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        ours.addHandler(handler)
    ours.setLevel(level)


#: Records waiting for the log thread past which new ones are dropped (a stream
#: that blocks for good must not grow memory without bound).
MAX_QUEUED_RECORDS = 1024


class SchedulerLogger(logging.Logger):
    """A logger whose records another thread writes (see the module docstring).

    Records carry ``target``'s name, level and the caller's file and line, and
    reach ``target``'s handlers (and its parents') from the
    ``kvstore-log-<label>`` thread. :meth:`close` writes what is queued and
    stops the thread; records after it are written at once by the caller.
    """

    def __init__(self, target: logging.Logger, label: str) -> None:
        super().__init__(target.name)
        self.target = target
        self._closed = False
        self._queue: SimpleQueue[logging.LogRecord | None] = SimpleQueue()
        #: Records dropped because the queue was full.
        self.dropped = 0
        self._thread = threading.Thread(target=self._write, name=f"kvstore-log-{label}",
                                        daemon=True)
        self._thread.start()

    def isEnabledFor(self, level: int) -> bool:
        return self.target.isEnabledFor(level)

    def handle(self, record: logging.LogRecord) -> None:
        """Queue ``record`` for the log thread: no lock, no formatting, never blocks."""
        if self._closed:
            self.target.handle(record)
        elif self._queue.qsize() >= MAX_QUEUED_RECORDS:
            self.dropped += 1
        else:
            self._queue.put(record)

    def close(self) -> None:
        """Write the queued records, stop the thread; later records go straight to ``target``."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            # A handler's own errors go to Handler.handleError; nothing else may end the thread.
            with contextlib.suppress(Exception):
                self.target.handle(record)
