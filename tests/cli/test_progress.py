"""Long stats and gc runs report their progress (the CLI draws it on stderr)."""

from __future__ import annotations

from pathlib import Path

from kvstore_tiers.admin import collect_stats, gc_store, open_store

N = 2500


def _many_objects(root: Path) -> None:
    shard = root / "ns_000000000000" / "abc"
    shard.mkdir(parents=True)
    for i in range(N):
        (shard / f"abc{i:061x}_g0.kvf").write_bytes(b"x")


def test_stats_and_gc_report_progress(tmp_path: Path) -> None:
    _many_objects(tmp_path)
    listed: list[int] = []
    with open_store({"type": "fs", "root_dir": str(tmp_path)}) as backend:
        st = collect_stats(backend, progress=listed.append)
        assert st.objects == N
        assert listed == [1000, 2000, N]
        seen: list[tuple[str, int, int | None]] = []
        res = gc_store(backend, max_bytes=0, progress=lambda *a: seen.append(a))
    assert res.deleted_objects == N
    assert seen == [("listing", 1000, None), ("listing", 2000, None),
                    ("deleting", 1000, N), ("deleting", 2000, N), ("deleting", N, N)]
    assert not list(tmp_path.rglob("*.kvf"))
