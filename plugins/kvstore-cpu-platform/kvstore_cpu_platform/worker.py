"""A synchronous host-memory copy worker for vLLM's OffloadingConnector on CPU.

On vLLM's CPU platform the "GPU" KV cache is ordinary host memory, so the
GPU<->primary transfers of the OffloadingConnector are plain memory copies.
vLLM's stock ``CPUOffloadingWorker`` cannot do them: it asserts CUDA/XPU
tensors, times with device events and copies with a CUDA-only kernel. This
worker keeps vLLM's *layout* logic — the per-group skip/count walk of
``SingleDirectionOffloadingHandler.transfer_async`` and vLLM's own
``compute_sub_block_ptrs`` pointer arithmetic for the direct layout — and
replaces the device copy by ``ctypes.memmove``, done synchronously inside
``submit_store``/``submit_load``.

Why synchronous is correct here: the connector submits stores at the start of
the step after the one that computed the KV (the model step that wrote those
pages has returned, since CPU execution is synchronous) and submits loads
before the forward pass that reads them; a copy that is finished when
``submit_*`` returns therefore satisfies both orderings without events.

Safety: every copy descriptor is bounds-checked against the extent of its
source and destination tensor *before* any byte moves, so a bad block id
raises ``ValueError`` instead of corrupting memory. The connector treats a
failed transfer as fatal anyway (it asserts ``success``), so raising with a
message that names the problem is the most useful failure mode.

Not supported (refused with ``ValueError`` at construction):
``canonical_layout`` (its fragment plans and writer rotation are a CUDA-path
feature we have not validated on CPU) and KV tensors that are not on the CPU
device.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

if TYPE_CHECKING:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

# A child of vLLM's "vllm" logger so the line shows up with vLLM's handler,
# format and VLLM_LOGGING_LEVEL (vLLM configures only that hierarchy).
logger = logging.getLogger("vllm.kvstore_cpu_platform")


class CPUOffloadUnsupportedError(ValueError):
    """A configuration the CPU copy worker deliberately does not handle."""


def _tensor_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``(base, end)`` byte addresses covered by a 2-D int8 ``(rows, cols)`` view.

    ``end`` is exclusive. Works for strided views (the shared-region worker
    views have ``stride(0) > shape[1]``)."""
    assert tensor.dim() == 2 and tensor.element_size() == 1
    base = int(tensor.data_ptr())
    rows, cols = tensor.shape
    if rows == 0 or cols == 0:
        return base, base
    return base, base + (rows - 1) * int(tensor.stride(0)) + cols


class _Direction:
    """One copy direction (GPU->CPU or CPU->GPU) over fixed tensor pairs.

    Mirrors vLLM's ``SingleDirectionOffloadingHandler`` for the direct layout:
    the CPU side holds ``blocks_per_chunk`` GPU pages per chunk row, so the
    GPU side advances one block per page and the CPU side one chunk per
    ``blocks_per_chunk`` pages.
    """

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
    ) -> None:
        self.gpu_to_cpu = gpu_to_cpu
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self.layer_refs_per_group = layer_refs_per_group
        self._src_extents = [_tensor_extent(t) for t in self.src_tensors]
        self._dst_extents = [_tensor_extent(t) for t in self.dst_tensors]

    def build_ops(
        self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return ``(src_ptrs, dst_ptrs, sizes)`` for one transfer, validated.

        Raises ``ValueError`` if the specs are malformed or any descriptor
        would touch bytes outside its tensor."""
        if not isinstance(src_spec, BlockIDsLoadStoreSpec) or not isinstance(
            dst_spec, BlockIDsLoadStoreSpec
        ):
            raise ValueError(
                f"unsupported load/store specs {type(src_spec).__name__} -> "
                f"{type(dst_spec).__name__}"
            )
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise ValueError(f"expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
        src_blocks = np.asarray(src_spec.block_ids)
        dst_blocks = np.asarray(dst_spec.block_ids)
        if src_blocks.ndim != 1 or dst_blocks.ndim != 1:
            raise ValueError("block id arrays must be 1-D")
        # Range-check ids up front: negative ids would wrap around in the
        # uint64 pointer arithmetic below (the extent check catches that too,
        # but this message is clearer).
        for name, blocks, tensors in (
            ("source", src_blocks, self.src_tensors),
            ("destination", dst_blocks, self.dst_tensors),
        ):
            num_rows = int(tensors[0].shape[0])
            if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= num_rows):
                raise ValueError(
                    f"{name} block id out of range [0, {num_rows}): "
                    f"min={int(blocks.min())} max={int(blocks.max())}"
                )

        group_sizes = list(gpu_spec.group_sizes)
        block_indices = list(gpu_spec.block_indices)
        if len(group_sizes) != len(self.layer_refs_per_group) or len(block_indices) != len(
            group_sizes
        ):
            raise ValueError(
                f"spec has {len(group_sizes)} group(s), the KV cache has "
                f"{len(self.layer_refs_per_group)}"
            )

        num_ops = sum(
            size * len(refs)
            for size, refs in zip(group_sizes, self.layer_refs_per_group, strict=True)
        )
        src_ptrs = np.empty(num_ops, dtype=np.uint64)
        dst_ptrs = np.empty(num_ops, dtype=np.uint64)
        sizes = np.empty(num_ops, dtype=np.int64)
        tensor_idx = np.empty(num_ops, dtype=np.int64)

        src_offset = dst_offset = op_idx = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(group_sizes, block_indices, strict=True)
        ):
            if group_size == 0:
                continue
            # Same walk as vLLM's transfer_async: the first chunk of a group
            # may start mid-chunk, given by the logical block index.
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_count = cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_count = cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            src_end = src_offset + src_count
            dst_end = dst_offset + dst_count
            if src_end > len(src_blocks) or dst_end > len(dst_blocks):
                raise ValueError("group sizes do not match the number of block ids")
            group_src = src_blocks[src_offset:src_end]
            group_dst = dst_blocks[dst_offset:dst_end]
            for ref in self.layer_refs_per_group[g_idx]:
                end = op_idx + group_size
                t = ref.tensor_idx
                compute_sub_block_ptrs(
                    group_src,
                    self.src_blocks_per_chunk,
                    src_ptrs[op_idx:end],
                    self.src_tensors[t],
                    skip_count=src_skip,
                )
                compute_sub_block_ptrs(
                    group_dst,
                    self.dst_blocks_per_chunk,
                    dst_ptrs[op_idx:end],
                    self.dst_tensors[t],
                    skip_count=dst_skip,
                )
                sizes[op_idx:end] = ref.page_size_bytes
                tensor_idx[op_idx:end] = t
                op_idx = end
            src_offset, dst_offset = src_end, dst_end
        if src_offset != len(src_blocks) or dst_offset != len(dst_blocks):
            raise ValueError("group sizes do not cover every block id")
        assert op_idx == num_ops

        self._check_extents(src_ptrs, sizes, tensor_idx, self._src_extents, "source")
        self._check_extents(dst_ptrs, sizes, tensor_idx, self._dst_extents, "destination")
        return src_ptrs, dst_ptrs, sizes

    @staticmethod
    def _check_extents(
        ptrs: np.ndarray,
        sizes: np.ndarray,
        tensor_idx: np.ndarray,
        extents: list[tuple[int, int]],
        name: str,
    ) -> None:
        """Raise unless every ``[ptr, ptr+size)`` lies inside its tensor."""
        if len(ptrs) == 0:
            return
        bases = np.array([e[0] for e in extents], dtype=np.uint64)[tensor_idx]
        ends = np.array([e[1] for e in extents], dtype=np.uint64)[tensor_idx]
        bad = (ptrs < bases) | (ptrs + sizes.astype(np.uint64) > ends) | (sizes < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name} copy descriptor {i} (tensor {int(tensor_idx[i])}, "
                f"{int(sizes[i])} bytes) falls outside its KV tensor; refusing to copy"
            )


class CPUMemmoveOffloadingWorker(OffloadingWorker):
    """``OffloadingWorker`` for vLLM's CPU platform: synchronous memmove copies.

    Constructor signature matches vLLM's ``CPUOffloadingWorker`` so that the
    specs' ``create_worker`` (which builds the shared offload region, or a
    private tensor, and handles cleanup on failure) can build this class
    unchanged.

    Contract:
      * ``submit_store``/``submit_load`` copy every byte before returning and
        return ``True``; a malformed spec raises ``ValueError`` before any byte
        is written.
      * ``get_finished`` returns each submitted job exactly once, with
        ``transfer_size`` (bytes) and ``transfer_time`` (seconds of copying).
      * ``wait`` returns at once (nothing is ever in flight).
      * ``shutdown`` drops tensor references and releases the mmap region.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
        **unsupported: Any,
    ) -> None:
        if canonical_layout:
            raise CPUOffloadUnsupportedError(
                "kvstore_cpu_platform: canonical_layout is not supported on vLLM's CPU "
                "platform; remove 'canonical_layout' from kv_connector_extra_config"
            )
        if unsupported:
            # A newer vLLM passing options we do not understand: refuse rather
            # than silently ignore something that changes the layout.
            raise CPUOffloadUnsupportedError(
                "kvstore_cpu_platform: unsupported CPUOffloadingWorker options "
                f"{sorted(unsupported)} (this vLLM is newer than the CPU copy worker)"
            )
        if blocks_per_chunk < 1:
            raise CPUOffloadUnsupportedError(
                f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}"
            )
        if not kv_caches.tensors:
            raise CPUOffloadUnsupportedError("no KV cache tensors to offload")

        self._mmap_region = mmap_region
        gpu_tensors: list[torch.Tensor] = []
        cpu_tensors: list[torch.Tensor] = []
        for kv_tensor in kv_caches.tensors:
            if kv_tensor.tensor.device.type != "cpu":
                raise CPUOffloadUnsupportedError(
                    "kvstore_cpu_platform: the CPU copy worker needs host-memory KV caches, "
                    f"got a tensor on {kv_tensor.tensor.device}"
                )
            page = kv_tensor.page_size_bytes
            # Same (num_blocks, page_bytes) int8 view vLLM's worker builds.
            gpu_tensor = kv_tensor.tensor.view(torch.int8).view((-1, page))
            cpu_page = page * blocks_per_chunk
            if mmap_region is not None:
                cpu_tensor = mmap_region.create_next_worker_view(cpu_page)
            else:
                cpu_tensor = torch.zeros((num_cpu_chunks, cpu_page), dtype=torch.int8)
            if tuple(cpu_tensor.shape) != (num_cpu_chunks, cpu_page):
                raise ValueError(
                    f"CPU view has shape {tuple(cpu_tensor.shape)}, expected "
                    f"{(num_cpu_chunks, cpu_page)}"
                )
            gpu_tensors.append(gpu_tensor)
            cpu_tensors.append(cpu_tensor)

        refs = kv_caches.group_data_refs
        for group in refs:
            for ref in group:
                if ref.page_size_bytes > kv_caches.tensors[ref.tensor_idx].page_size_bytes:
                    raise ValueError("a layer's page is larger than its tensor's page")
        self._store = _Direction(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, True)
        self._load = _Direction(gpu_tensors, cpu_tensors, blocks_per_chunk, refs, False)
        self._finished: deque[TransferResult] = deque()
        self._gpu_tensors = gpu_tensors
        self._cpu_tensors = cpu_tensors
        logger.info(
            "kvstore_cpu_platform: synchronous memmove offloading worker ready "
            "(%d KV tensor(s), %d CPU chunk(s), %d block(s) per chunk, %s)",
            len(gpu_tensors),
            num_cpu_chunks,
            blocks_per_chunk,
            "shared offload region" if mmap_region is not None else "private buffer",
        )

    @staticmethod
    def _copy(job_id: int, ops: tuple[np.ndarray, np.ndarray, np.ndarray]) -> TransferResult:
        src_ptrs, dst_ptrs, sizes = ops
        memmove = ctypes.memmove
        start = time.perf_counter()
        for src, dst, size in zip(
            src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True
        ):
            memmove(dst, src, size)
        elapsed = time.perf_counter() - start
        return TransferResult(
            job_id=job_id,
            success=True,
            transfer_size=int(sizes.sum()),
            transfer_time=elapsed,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy GPU (host) KV pages into CPU chunks; done when this returns."""
        self._finished.append(self._copy(job_id, self._store.build_ops(src_spec, dst_spec)))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy CPU chunks into GPU (host) KV pages; done when this returns."""
        self._finished.append(self._copy(job_id, self._load.build_ops(src_spec, dst_spec)))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Every job submitted since the last call, each exactly once."""
        out: list[TransferResult] = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait(self, job_ids: set[int]) -> None:
        """No-op: transfers complete inside ``submit_*``."""
        return

    def shutdown(self) -> None:
        """Drop tensor views (they pin the mmap) and release the region."""
        self._gpu_tensors.clear()
        self._cpu_tensors.clear()
        self._store = self._load = None  # type: ignore[assignment]
        region, self._mmap_region = self._mmap_region, None
        if region is not None:
            region.cleanup()
