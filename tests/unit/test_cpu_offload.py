"""Unit tests of the kvstore-cpu-platform plugin (plugins/kvstore-cpu-platform):
the CPU-platform copy worker and its idempotent vLLM patch."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

# This checkout's plugin, installed or not (as PYTHONPATH=$PWD does for kvstore_tiers).
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins" / "kvstore-cpu-platform"
sys.path.insert(0, str(PLUGIN_DIR))

import kvstore_cpu_platform as cpu_offload  # noqa: E402
from kvstore_cpu_platform.worker import (  # noqa: E402
    CPUMemmoveOffloadingWorker,
    CPUOffloadUnsupportedError,
)

NUM_GPU_BLOCKS = 8
NUM_CPU_CHUNKS = 4
# Two KV tensors with different page sizes; the second one's layer page is
# "unpadded" (smaller than the tensor page), like vLLM's padded pages.
PAGES = (256, 384)
UNPADDED = (256, 320)


def _kv_caches(seed: int = 0) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """A fake 1-group, 2-layer KV cache of random bytes (host memory)."""
    gen = torch.Generator().manual_seed(seed)
    raw = [
        torch.randint(-128, 128, (NUM_GPU_BLOCKS, p), dtype=torch.int8, generator=gen)
        for p in PAGES
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(raw, PAGES, strict=True)],
        group_data_refs=[[CanonicalKVCacheRef(i, UNPADDED[i]) for i in range(len(PAGES))]],
    )
    return caches, raw


def _gpu_spec(block_ids: list[int], first_block_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(
        block_ids, group_sizes=[len(block_ids)], block_indices=[first_block_index]
    )


def _chunk_page(worker: CPUMemmoveOffloadingWorker, t: int, chunk: int, sub: int) -> np.ndarray:
    """Bytes of sub-block ``sub`` of CPU chunk ``chunk`` in tensor ``t``."""
    cpu = worker._cpu_tensors[t]
    page = PAGES[t]
    return cpu[chunk, sub * page : sub * page + UNPADDED[t]].numpy()


def test_store_then_load_is_byte_exact() -> None:
    caches, raw = _kv_caches()
    worker = CPUMemmoveOffloadingWorker(caches, blocks_per_chunk=2, num_cpu_chunks=NUM_CPU_CHUNKS)
    gpu_blocks = [5, 1, 6, 3]  # -> CPU chunks 2 (blocks 5,1) and 0 (blocks 6,3)
    assert worker.submit_store(7, _gpu_spec(gpu_blocks), CPULoadStoreSpec([2, 0]))
    (res,) = worker.get_finished()
    assert res.job_id == 7 and res.success
    assert res.transfer_size == len(gpu_blocks) * sum(UNPADDED)
    assert worker.get_finished() == []  # each job reported once
    for t in range(2):
        for i, (chunk, sub) in enumerate([(2, 0), (2, 1), (0, 0), (0, 1)]):
            np.testing.assert_array_equal(
                _chunk_page(worker, t, chunk, sub), raw[t][gpu_blocks[i], : UNPADDED[t]].numpy()
            )
        # padding bytes of a page are not part of the layer's data: not copied
        if UNPADDED[t] < PAGES[t]:
            assert not worker._cpu_tensors[t][2, UNPADDED[t] : PAGES[t]].any()
        # untouched chunks stay zero
        assert not worker._cpu_tensors[t][1].any() and not worker._cpu_tensors[t][3].any()

    # Load both chunks back into other GPU blocks: identical bytes.
    expected = [r[[5, 1, 6, 3]].clone() for r in raw]
    for r in raw:
        r[[0, 2, 4, 7]] = 0
    assert worker.submit_load(8, CPULoadStoreSpec([2, 0]), _gpu_spec([0, 2, 4, 7]))
    (res,) = worker.get_finished()
    assert res.job_id == 8 and res.success and res.transfer_time is not None
    for t in range(2):
        np.testing.assert_array_equal(
            raw[t][[0, 2, 4, 7], : UNPADDED[t]].numpy(), expected[t][:, : UNPADDED[t]].numpy()
        )
    worker.wait({7, 8})  # nothing in flight: returns at once
    worker.shutdown()


def test_unaligned_first_chunk_uses_block_index() -> None:
    """A group starting at logical block 1 with 2 blocks/chunk starts mid-chunk."""
    caches, raw = _kv_caches(1)
    worker = CPUMemmoveOffloadingWorker(caches, blocks_per_chunk=2, num_cpu_chunks=NUM_CPU_CHUNKS)
    # logical blocks 1,2,3 -> chunk A (sub 1), chunk B (sub 0, 1)
    worker.submit_store(1, _gpu_spec([4, 0, 2], first_block_index=1), CPULoadStoreSpec([3, 1]))
    for t in range(2):
        np.testing.assert_array_equal(
            _chunk_page(worker, t, 3, 1), raw[t][4, : UNPADDED[t]].numpy()
        )
        np.testing.assert_array_equal(
            _chunk_page(worker, t, 1, 0), raw[t][0, : UNPADDED[t]].numpy()
        )
        np.testing.assert_array_equal(
            _chunk_page(worker, t, 1, 1), raw[t][2, : UNPADDED[t]].numpy()
        )
        assert not _chunk_page(worker, t, 3, 0).any()  # skipped half untouched

    # load the second half of chunk 3 only (logical block 1) into GPU block 7
    worker.submit_load(2, CPULoadStoreSpec([3]), _gpu_spec([7], first_block_index=1))
    for t in range(2):
        np.testing.assert_array_equal(
            raw[t][7, : UNPADDED[t]].numpy(), raw[t][4, : UNPADDED[t]].numpy()
        )
    assert [r.job_id for r in worker.get_finished()] == [1, 2]


def test_out_of_range_ids_refused_without_touching_memory() -> None:
    caches, raw = _kv_caches(2)
    worker = CPUMemmoveOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=NUM_CPU_CHUNKS)
    before = [r.clone() for r in raw]
    with pytest.raises(ValueError, match="destination block id out of range"):
        worker.submit_store(1, _gpu_spec([0, 1]), CPULoadStoreSpec([0, NUM_CPU_CHUNKS]))
    with pytest.raises(ValueError, match="source block id out of range"):
        worker.submit_store(2, _gpu_spec([-1]), CPULoadStoreSpec([0]))
    with pytest.raises(ValueError, match="destination block id out of range"):
        worker.submit_load(3, CPULoadStoreSpec([0]), _gpu_spec([NUM_GPU_BLOCKS]))
    with pytest.raises(ValueError, match="group sizes"):
        worker.submit_store(4, _gpu_spec([0, 1]), CPULoadStoreSpec([0]))
    assert all(not t.any() for t in worker._cpu_tensors)
    assert all(torch.equal(a, b) for a, b in zip(before, raw, strict=True))
    assert worker.get_finished() == []


def test_refuses_canonical_layout_and_non_host_tensors() -> None:
    caches, _ = _kv_caches()
    with pytest.raises(CPUOffloadUnsupportedError, match="canonical_layout"):
        CPUMemmoveOffloadingWorker(caches, 1, NUM_CPU_CHUNKS, None, canonical_layout=True)
    meta = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(torch.empty((4, 256), dtype=torch.int8, device="meta"), 256)
        ],
        group_data_refs=[[CanonicalKVCacheRef(0, 256)]],
    )
    with pytest.raises(CPUOffloadUnsupportedError, match="host-memory"):
        CPUMemmoveOffloadingWorker(meta, 1, NUM_CPU_CHUNKS)
    with pytest.raises(CPUOffloadUnsupportedError, match="newer"):
        CPUMemmoveOffloadingWorker(caches, 1, NUM_CPU_CHUNKS, None, False, populate_shard=True)


@pytest.fixture
def patched_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Install the real patch in this process (it is process-wide and idempotent).

    Under a GPU build of vLLM on a machine without a GPU (the vLLM 0.33 check
    in scripts/test-vllm-033.sh) the platform is not "cpu" and ``register``
    rightly does nothing; the platform is then taken for CPU while the patch
    goes in, so the patch is still checked against that vLLM's own classes.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    cpu_offload.register()
    assert cpu_offload.is_active()
    yield


def test_register_is_idempotent_and_patches_both_specs(patched_vllm: None) -> None:
    from vllm.v1.kv_offload.cpu import spec as cpu_spec
    from vllm.v1.kv_offload.tiering import spec as tiering_spec

    get_worker = cpu_spec.CPUOffloadingSpec.get_worker
    cpu_offload.register()
    cpu_offload.register()
    assert cpu_spec.CPUOffloadingSpec.get_worker is get_worker
    assert cpu_spec.CPUOffloadingWorker is CPUMemmoveOffloadingWorker
    assert tiering_spec.CPUOffloadingWorker is CPUMemmoveOffloadingWorker
    # vLLM's own worker module is left alone
    from vllm.v1.kv_offload.cpu import gpu_worker

    assert gpu_worker.CPUOffloadingWorker is not CPUMemmoveOffloadingWorker


def test_a_second_copy_of_the_patch_changes_nothing(patched_vllm: None) -> None:
    """Two entry points with the same patch in one process (a kvstore-tiers that
    still ships it beside this plugin): the second finds the marker and stays out."""
    from vllm.v1.kv_offload.cpu import spec as cpu_spec

    get_worker = cpu_spec.CPUOffloadingSpec.get_worker
    original = vars(cpu_spec.CPUOffloadingSpec)[cpu_offload.PATCH_MARKER]
    copy_spec = importlib.util.spec_from_file_location(
        "kvstore_cpu_platform_copy", PLUGIN_DIR / "kvstore_cpu_platform" / "__init__.py",
        submodule_search_locations=[])
    assert copy_spec is not None and copy_spec.loader is not None
    copy = importlib.util.module_from_spec(copy_spec)
    copy_spec.loader.exec_module(copy)
    copy.register()
    copy.register()
    assert cpu_spec.CPUOffloadingSpec.get_worker is get_worker
    assert vars(cpu_spec.CPUOffloadingSpec)[cpu_offload.PATCH_MARKER] is original
    assert cpu_spec.CPUOffloadingWorker is CPUMemmoveOffloadingWorker
    assert copy.is_active()


def test_tiering_spec_worker_writes_the_scheduler_primary_view(patched_vllm: None) -> None:
    """Through vLLM's real TieringOffloadingSpec: the worker's shared-region
    writes are what the scheduler-side primary memoryview (the tiers' view) sees."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    caches, raw = _kv_caches(3)
    worker_bytes_per_block = sum(PAGES)
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": NUM_CPU_CHUNKS * 4096,
            "secondary_tiers": [],
        },
        engine_id=f"kvst-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    spec = OffloadingSpecFactory.create_spec(cfg)
    manager = spec.get_manager()
    worker = spec.get_worker(caches)
    try:
        assert isinstance(worker, CPUMemmoveOffloadingWorker)
        assert spec.get_worker(caches) is worker
        worker.submit_store(1, _gpu_spec([6, 2]), CPULoadStoreSpec([3, 0]))
        view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.int8).reshape(
            NUM_CPU_CHUNKS, -1
        )
        # row layout: |tensor0 page|tensor1 page|pad| (one worker)
        for chunk, block in ((3, 6), (0, 2)):
            np.testing.assert_array_equal(
                view[chunk, : UNPADDED[0]], raw[0][block, : UNPADDED[0]].numpy()
            )
            off = PAGES[0]
            np.testing.assert_array_equal(
                view[chunk, off : off + UNPADDED[1]], raw[1][block, : UNPADDED[1]].numpy()
            )
        assert not view[1].any() and not view[2].any()
    finally:
        del view
        worker.shutdown()
        manager.shutdown()


def _fake_modules(with_get_worker: bool = True) -> list[types.ModuleType]:
    class CPUOffloadingSpec:
        def create_worker(self, kv_caches: object) -> object:
            # resolves the module-global name, like vLLM's create_worker
            return mod.CPUOffloadingWorker(kv_caches)

    if with_get_worker:

        def get_worker(self: object, kv_caches: object) -> object:
            raise RuntimeError("CPU Offloading is currently only supported on CUDA-alike")

        CPUOffloadingSpec.get_worker = get_worker  # type: ignore[attr-defined]

    mod = types.ModuleType("fake_cpu_spec")
    mod.CPUOffloadingSpec = CPUOffloadingSpec  # type: ignore[attr-defined]
    mod.CPUOffloadingWorker = object  # type: ignore[attr-defined]
    tiering = types.ModuleType("fake_tiering_spec")
    tiering.CPUOffloadingWorker = object  # type: ignore[attr-defined]
    return [mod, tiering]


def test_apply_patch_on_stand_in_modules() -> None:
    class FakeWorker:
        def __init__(self, kv_caches: object) -> None:
            self.kv_caches = kv_caches

    mods = _fake_modules()
    assert cpu_offload.apply_patch(mods, FakeWorker) is True
    assert cpu_offload.apply_patch(mods, FakeWorker) is False  # idempotent
    spec = mods[0].CPUOffloadingSpec()
    spec._worker = None
    w = spec.get_worker("kv")
    assert isinstance(w, FakeWorker) and spec.get_worker("other") is w
    assert mods[1].CPUOffloadingWorker is FakeWorker


def test_apply_patch_leaves_unexpected_vllm_alone(caplog: pytest.LogCaptureFixture) -> None:
    mods = _fake_modules(with_get_worker=False)
    with caplog.at_level(logging.WARNING, logger="vllm.kvstore_cpu_platform"):
        assert cpu_offload.apply_patch(mods, object) is False
    assert mods[0].CPUOffloadingWorker is object and mods[1].CPUOffloadingWorker is object
    assert "not patching" in caplog.text
    empty = types.ModuleType("empty")
    assert cpu_offload.apply_patch([empty], object) is False


def test_register_never_raises_and_skips_non_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    def boom(*_a: object, **_k: object) -> bool:
        raise RuntimeError("unexpected vLLM")

    # Failure inside the patch: logged, swallowed.
    monkeypatch.setattr(cpu_offload, "apply_patch", boom)
    cpu_offload.register()
    # Not the CPU platform: the patch is not even attempted (boom not reached
    # is shown by register returning normally *and* no warning being needed).
    calls: list[int] = []
    monkeypatch.setattr(cpu_offload, "apply_patch", lambda *a: calls.append(1) or True)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    cpu_offload.register()
    assert calls == []
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    cpu_offload.register()
    assert calls == [1]
