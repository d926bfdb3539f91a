"""CPU cost per GB moved, and this machine's memory speed as the reference.

A throughput figure says how fast; CPU seconds per GB say what it costs the
engine's cores, which vLLM's scheduler and the model share with the tier.
:class:`CpuClock` reads this process's CPU time (user + system, every
thread: ``getrusage(RUSAGE_SELF)``) around a timed window. Servers the
bench starts (redis-server, moto) are other processes: only the client side
is counted. :func:`reference` measures, in the same run, single-thread
memcpy and CRC-32C over the same bytes: a load cannot beat one copy plus its
checksum per byte unless it spreads them over threads.
"""

from __future__ import annotations

import resource
import time

import numpy as np

GB = 1e9
MiB = 1 << 20


def process_cpu_s() -> float:
    """CPU seconds (user + system) this process has used, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class CpuClock:
    """Process CPU seconds from construction to :meth:`per_gb`; also, with
    :meth:`split_per_gb`, those of every thread but the one that made it."""

    __slots__ = ("_own0", "_t0")

    def __init__(self) -> None:
        self._t0 = process_cpu_s()
        self._own0 = time.thread_time()

    def seconds(self) -> float:
        return process_cpu_s() - self._t0

    def per_gb(self, nbytes: int) -> float:
        """CPU seconds so far per GB (1e9 bytes) of ``nbytes`` moved."""
        return self.seconds() / (nbytes / GB)

    def split_per_gb(self, nbytes: int) -> tuple[float, float]:
        """(:meth:`per_gb`, the same less the calling thread's own CPU), from
        one reading; call it on the thread that made the clock. For a bench
        whose driving thread plays vLLM's scheduler loop: that loop polls
        every 0.2-1 ms, so its CPU grows with wall time rather than with the
        bytes moved (on a disk, whose speed varies by tens of percent between
        rounds, it swamps the rest). What is left is the I/O threads; the
        tier's own scheduler-side calls, which ran on the driving thread, are
        left out with the loop (the bench times them on their own)."""
        own, total = time.thread_time() - self._own0, self.seconds()
        return total / (nbytes / GB), (total - own) / (nbytes / GB)


def memcpy_gbps(src: np.ndarray, dst: np.ndarray, repeats: int = 5) -> float:
    """GB/s of one thread copying ``src`` to ``dst`` (``np.copyto``), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / GB


def crc32c_gbps(data: np.ndarray, repeats: int = 5) -> float:
    """GB/s of the crc32c package (the frames' checksum) over ``data``, best of ``repeats``."""
    import crc32c

    view = memoryview(data).cast("B")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        crc32c.crc32c(view)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / GB


def reference(nbytes: int = 256 * MiB, repeats: int = 5) -> dict[str, float]:
    """This machine's single-thread memcpy and CRC-32C GB/s over ``nbytes`` of
    incompressible bytes (preallocated and touched before timing)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: no page faults inside the timed copies
    return {"bytes": nbytes, "repeats": repeats, "memcpy_gbps": memcpy_gbps(src, dst, repeats),
            "crc32c_gbps": crc32c_gbps(src, repeats)}
