"""The tier's log lines from vLLM's scheduler thread are written by another thread.

Writing a record takes each handler's lock and writes its stream: an I/O
thread logging at that moment, or a stream that blocks (a full pipe to a slow
log collector), would hold the scheduler. During a node loss the scheduler
thread logs the failed stores and the circuit opening; here the stream blocks
until the end of the test, and the scheduler keeps going.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys

from ..conftest import rows_like
from .flaky import flaky_tier

ROW = 4096


class BlockedStream(logging.Handler):
    """A handler whose stream blocks until ``gate`` opens, noting which thread writes.

    It never blocks the test's own thread (vLLM's scheduler here): a write
    there is noted, and the test fails on it, rather than hanging.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.writes: list[tuple[int, str]] = []  # (thread ident, message)

    def emit(self, record: logging.LogRecord) -> None:
        self.writes.append((threading.get_ident(), record.getMessage()))
        if threading.get_ident() != threading.main_thread().ident:
            self.gate.wait(60)


@pytest.fixture
def stream() -> Iterator[BlockedStream]:
    handler = BlockedStream()
    ours = logging.getLogger("kvstore_tiers")
    ours.addHandler(handler)
    yield handler
    handler.gate.set()
    ours.removeHandler(handler)


def test_a_blocked_log_stream_does_not_hold_the_scheduler(harness_factory, tmp_path, flaky,
                                                         stream) -> None:
    assert threading.current_thread() is threading.main_thread()
    h = harness_factory([flaky_tier(tmp_path, failure_threshold=1)], num_chunks=32,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(8, seed=31)
    flaky.dead.update(keys[:4])  # a dead node: the job fails, the circuit opens
    h.store_all(keys[:4], rows_like(4, ROW, seed=31))
    # The log thread is stuck in the stream; the scheduler goes on.
    h.store_all(keys[4:], rows_like(4, ROW, seed=32))
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [LookupResult.MISS] * 8  # none stored
    h.finish_request(ctx)
    assert tier.counters.store_failures == 4 and tier.breaker.times_opened == 1

    stream.gate.set()  # the log thread writes what is queued
    deadline = time.monotonic() + 30
    while len(lines := _failure_lines(stream)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(lines) == 2, stream.writes
    main = threading.main_thread().ident
    assert all(who != main for who, _ in lines), "written on the scheduler thread"


def _failure_lines(stream: BlockedStream) -> list[tuple[int, str]]:
    return [(who, text) for who, text in list(stream.writes)
            if "stores failed" in text or "circuit open" in text]


def test_a_full_log_queue_drops_records_quietly(stream, capfd) -> None:
    """Past MAX_QUEUED_RECORDS waiting records new ones are counted and dropped: the
    scheduler thread neither blocks nor writes (not even a logging error to stderr)."""
    from kvstore_tiers.log import MAX_QUEUED_RECORDS, SchedulerLogger

    log = SchedulerLogger(logging.getLogger("kvstore_tiers.test_full_queue"), "full-queue")
    total = MAX_QUEUED_RECORDS + 50
    try:
        for i in range(total):
            log.warning("record %d", i)
        assert log.dropped >= 49  # the queue is full; the log thread holds one at most
        assert threading.main_thread().ident not in {who for who, _ in stream.writes}
    finally:
        stream.gate.set()
        log.close()
    written = [text for _, text in stream.writes if text.startswith("record ")]
    assert len(written) + log.dropped == total
    assert written[:2] == ["record 0", "record 1"]  # in order, formatted by the log thread
    # Other handlers of the package's logger (vLLM's, once it configured logging) may write
    # the records from the log thread; what must never appear is logging's own error report,
    # which the stock QueueHandler prints on the caller's thread when its queue is full.
    err = capfd.readouterr().err
    assert "--- Logging error ---" not in err and "queue.Full" not in err
    log.warning("after close")  # written at once, by the caller
    assert stream.writes[-1] == (threading.main_thread().ident, "after close")
