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
bounded queue instead (the standard library's QueueHandler), and a thread of
its own (a QueueListener) hands them to the real logger.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import queue
import sys

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


class _Enqueue(logging.handlers.QueueHandler):
    """The standard QueueHandler, made safe for the scheduler thread.

    The record goes on the queue as it is: QueueHandler would format it first
    (``msg % args``, and for an exception its traceback, which reads source
    files), work that belongs to the listener's thread. A full queue drops the
    record and counts it, where QueueHandler would report ``queue.Full``
    through ``handleError`` -- a traceback written to stderr on this thread.
    """

    def __init__(self, q: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(q)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # same process: the listener's handlers format it

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _ToLogger(logging.Handler):
    """Hands each record to ``target`` (its handlers and its parents'), as if logged there."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def handle(self, record: logging.LogRecord) -> bool:
        # No lock of ours: the target's handlers take their own. A handler's own
        # errors go to its handleError; nothing else may end the listener's thread.
        with contextlib.suppress(Exception):
            self.target.handle(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover - handle() above
        self.handle(record)


class _Listener(logging.handlers.QueueListener):
    """QueueListener on a named thread, whose stop waits for room on a full (bounded) queue."""

    def __init__(self, q: queue.Queue[logging.LogRecord | None], handler: logging.Handler,
                 thread_name: str) -> None:
        super().__init__(q, handler)
        self.thread_name = thread_name

    def start(self) -> None:
        super().start()
        self._thread.name = self.thread_name  # type: ignore[union-attr]

    def enqueue_sentinel(self) -> None:
        self.queue.put(self._sentinel)  # blocks until the listener makes room


class SchedulerLogger(logging.Logger):
    """A logger whose records another thread writes (see the module docstring).

    The standard library's :class:`~logging.handlers.QueueHandler` and
    :class:`~logging.handlers.QueueListener` over a bounded queue: the caller
    only puts the record on the queue (no formatting, no handler lock but the
    queue handler's own, uncontended, never blocking); the listener's
    ``kvstore-log-<label>`` thread hands it to ``target``, whose handlers (and
    its parents') write it with the caller's file and line. :meth:`close`
    writes what is queued and stops the thread; records after it are written
    at once by the caller.
    """

    def __init__(self, target: logging.Logger, label: str) -> None:
        super().__init__(target.name)
        self.target = target
        self.propagate = False  # the listener hands records to target, parents included
        self._forward = _ToLogger(target)
        q: queue.Queue[logging.LogRecord | None] = queue.Queue(MAX_QUEUED_RECORDS)
        self._enqueue = _Enqueue(q)
        self.addHandler(self._enqueue)
        self._listener = _Listener(q, self._forward, f"kvstore-log-{label}")
        self._listener.start()

    @property
    def dropped(self) -> int:
        """Records dropped because the queue was full."""
        return self._enqueue.dropped

    def isEnabledFor(self, level: int) -> bool:
        return self.target.isEnabledFor(level)

    def close(self) -> None:
        """Write the queued records, stop the thread; later records go straight to ``target``."""
        if self._enqueue in self.handlers:
            self.removeHandler(self._enqueue)
            self._listener.stop()
            self.addHandler(self._forward)
