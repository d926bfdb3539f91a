"""CPU seconds per GB in the bench, and the memcpy and CRC-32C reference beside it."""

from __future__ import annotations

import io

from rich.console import Console

from kvstore_tiers.plugin import register
from kvstore_tiers.tools.bench import cpu, fs_bench
from kvstore_tiers.tools.bench.tables import print_tables


def test_the_reference_is_measured() -> None:
    ref = cpu.reference(4 << 20, repeats=2)
    assert ref["bytes"] == 4 << 20
    assert ref["memcpy_gbps"] > 0 and ref["crc32c_gbps"] > 0


def test_the_cpu_clock_counts_this_process_s_work() -> None:
    clock = cpu.CpuClock()
    sum(i * i for i in range(200_000))  # work on this thread
    assert clock.seconds() > 0 and clock.per_gb(1 << 30) > 0


def test_the_cpu_clock_can_leave_out_its_own_thread() -> None:
    import threading

    clock = cpu.CpuClock()
    sum(i * i for i in range(2_000_000))  # the caller's own work: left out
    _, own_only = clock.split_per_gb(1 << 30)
    worker = threading.Thread(target=lambda: sum(i * i for i in range(2_000_000)))
    worker.start()
    worker.join()
    total, others = clock.split_per_gb(1 << 30)
    # The worker's CPU is counted; the caller's, about as much, is not.
    assert others > own_only
    assert others < 0.8 * total


def test_a_tiny_fs_run_has_positive_cpu_columns_for_both_tiers(tmp_path) -> None:
    register()  # "vllm_fs" beside our "fs"
    row = fs_bench.throughput_row(tmp_path, 64 * 1024, 16, 1, 2,
                                  {"read_gbps": 1.0, "write_gbps": 1.0})
    for kind in fs_bench.TIERS:
        for op in ("store", "load"):
            assert row[f"{kind}_{op}_cpu_s_per_gb"] > 0, (kind, op)
            # The I/O threads' share: some CPU, never more than the process's.
            assert 0 < row[f"{kind}_{op}_io_cpu_s_per_gb"] <= row[f"{kind}_{op}_cpu_s_per_gb"]
    assert list(tmp_path.iterdir()) == []
    out = io.StringIO()
    result = {"reference": cpu.reference(1 << 20, repeats=1),
              "fs": {"throughput": [row], "disk": {row["chunk_bytes"]: {"read_gbps": 1.0,
                                                                         "write_gbps": 1.0}},
                     "scheduler": {}}}
    print_tables(result, Console(file=out, width=250))
    text = out.getvalue()
    assert "store CPU s/GB ours" in text and "load/memcpy ours" in text
    assert "I/O threads: ours" in text
    assert "memcpy (numpy copyto)" in text and "CRC-32C" in text
