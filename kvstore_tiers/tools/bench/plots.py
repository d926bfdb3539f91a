"""PNG plots of a ``kvstore-tiers bench`` result (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KiB = 1 << 10


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: never try to open a window
    import matplotlib.pyplot as plt

    return plt


def _disk(result: dict[str, Any], chunk: int) -> dict[str, float]:
    disk = result["disk"]
    return disk.get(chunk) or disk.get(str(chunk)) or {}


def plot_fs_throughput(fs: dict[str, Any], path: Path) -> Path:
    """Store and load GB/s by chunk size: ours, vLLM's stock fs, disk O_DIRECT;
    one column per concurrency (1 and 4 requests)."""
    plt = _plt()
    reqs = sorted({r["requests"] for r in fs["throughput"]})
    mode = "O_DIRECT" if fs.get("disk_o_direct", True) else "buffered"
    fig, axes = plt.subplots(2, len(reqs), figsize=(5.5 * len(reqs), 7), squeeze=False,
                             sharey="row")
    for col, n_req in enumerate(reqs):
        rows = sorted((r for r in fs["throughput"] if r["requests"] == n_req),
                      key=lambda r: r["chunk_bytes"])
        chunks = [r["chunk_bytes"] for r in rows]
        labels = [f"{c // KiB} KiB" if c < 1 << 20 else f"{c >> 20} MiB" for c in chunks]
        x = list(range(len(chunks)))
        for row_i, (op, disk_key) in enumerate((("store", "write_gbps"), ("load", "read_gbps"))):
            ax = axes[row_i][col]
            w = 0.38
            ax.bar([i - w / 2 for i in x], [r[f"kvstore_{op}_gbps"] for r in rows], w,
                   label="kvstore-tiers fs", color="#1f77b4")
            ax.bar([i + w / 2 for i in x], [r[f"vllm_{op}_gbps"] for r in rows], w,
                   label="vLLM stock fs", color="#bbbbbb")
            ax.plot(x, [_disk(fs, c).get(disk_key, float("nan")) for c in chunks], "k--o",
                    label=f"disk {mode} {disk_key.split('_')[0]}")
            ax.set_xticks(x, labels)
            ax.set_title(f"{op}, {n_req} request{'s' if n_req > 1 else ''}")
            ax.set_ylabel("GB/s")
            ax.grid(axis="y", alpha=0.3)
            if row_i == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle("fs tier under vLLM's TieringOffloadingManager (median of rounds, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scheduler(fs: dict[str, Any], path: Path) -> Path:
    """p50/p99 scheduler-thread microseconds per call, ours vs stock, per method."""
    plt = _plt()
    sched = fs["scheduler"]
    methods = list(next(iter(sched.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.2
    x = list(range(len(methods)))
    colours = {"kvstore": ("#1f77b4", "#9ecae1"), "vllm": ("#636363", "#cccccc")}
    for j, (kind, label) in enumerate((("kvstore", "kvstore-tiers"), ("vllm", "vLLM stock"))):
        if kind not in sched:
            continue
        for k, q in enumerate(("p50", "p99")):
            off = (j * 2 + k - 1.5) * w
            ax.bar([i + off for i in x], [sched[kind][m][f"{q}_us"] for m in methods], w,
                   label=f"{label} {q}", color=colours[kind][k])
    ax.set_xticks(x, methods)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds per call (log)")
    ax.set_title("scheduler-thread time of the tier methods vLLM calls")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compression(rows: list[dict[str, Any]], path: Path) -> Path:
    """Compression ratio and effective load GB/s per codec, real KV samples."""
    plt = _plt()
    files = sorted({r["file"] for r in rows})
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / len(files)
    for fi, f in enumerate(files):
        sub = {r["codec"]: r for r in rows if r["file"] == f}
        x = [i + (fi - (len(files) - 1) / 2) * w for i in range(len(codecs))]
        axes[0].bar(x, [sub[c]["ratio"] for c in codecs], w, label=f)
        axes[1].bar(x, [sub[c]["load_effective_gbps"] for c in codecs], w, label=f)
    axes[0].set_title("compression ratio (raw / stored, 4 KiB header included)")
    axes[1].set_title("effective load GB/s (raw KV bytes per second)")
    for ax in axes:
        ax.set_xticks(range(len(codecs)), codecs)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict[str, Any], out_dir: Path, prefix: str = "bench") -> list[Path]:
    """Every plot that the result has data for; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fs = result.get("fs") or {}
    if fs.get("throughput"):
        written.append(plot_fs_throughput(fs, out_dir / f"{prefix}-fs-throughput.png"))
    if fs.get("scheduler"):
        written.append(plot_scheduler(fs, out_dir / f"{prefix}-scheduler.png"))
    if fs.get("compression"):
        written.append(plot_compression(fs["compression"], out_dir / f"{prefix}-compression.png"))
    return written


def plot_trace(trace: dict[str, Any], path: Path) -> Path:
    """Hit rate and bytes written against capacity, one line per (tier, policy);
    the plain LRU reference dashed."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = trace["rows"]
    for tier, policy in dict.fromkeys((r["tier"], r["policy"]) for r in rows):
        sub = sorted((r for r in rows if r["tier"] == tier and r["policy"] == policy),
                     key=lambda r: r["capacity_percent"])
        x = [r["capacity_percent"] for r in sub]
        line = axes[0].plot(x, [r["block_hit_rate"] for r in sub], "o-",
                            label=f"{tier} {policy}")[0]
        axes[1].plot(x, [r["bytes_written"] / 2**30 for r in sub], "o-",
                     color=line.get_color(), label=f"{tier} {policy}")
        refs = [r["reference"] for r in sub]
        if tier == "fs" and all(refs):
            axes[0].plot(x, [f["block_hit_rate"] for f in refs], "--", color=line.get_color(),
                         alpha=0.5, label=f"plain LRU {policy}")
            axes[1].plot(x, [f["blocks_written"] * trace["chunk_bytes"] / 2**30 for f in refs],
                         "--", color=line.get_color(), alpha=0.5)
    axes[0].set_ylabel("hit rate (blocks served / blocks requested)")
    axes[1].set_ylabel(f"GiB written ({trace['chunk_bytes'] // KiB} KiB chunks)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("capacity, % of the distinct blocks")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"write economics: {trace['requests']:,} requests of "
                 f"{Path(trace['trace']).name}, vLLM's tiering manager")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
