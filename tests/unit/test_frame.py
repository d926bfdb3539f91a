"""Frames: every mismatch is ObjectCorrupt, never wrong bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_tiers.codecs import CodecId
from kvstore_tiers.errors import ObjectCorrupt
from kvstore_tiers.frame import (
    CHECKSUM_AT,
    FLAG_ENCRYPTED,
    HEADER_FIXED,
    FrameCodec,
    FrameRead,
    Unplanned,
    checksum,
    header_length,
    parse_header,
)

NS = b"N" * 16
KEY = b"\x01" * 32 + (0).to_bytes(4, "big")


def _frame(codec: CodecId = CodecId.NONE, align: int = 8, seed: int = 0) -> tuple[bytes, bytes]:
    raw = np.random.default_rng(seed).integers(0, 4, 8192, dtype=np.uint8).tobytes()
    header, payload = FrameCodec(NS, codec, align).encode(KEY, memoryview(raw))
    return bytes(header) + bytes(payload), raw


@pytest.mark.parametrize("codec", list(CodecId))
def test_roundtrip_and_header_fields(codec: CodecId) -> None:
    frame, raw = _frame(codec)
    dest = bytearray(len(raw))
    header = FrameCodec(NS, codec).decode_into(KEY, frame, memoryview(dest))
    assert bytes(dest) == raw
    assert header.key == KEY and header.namespace == NS and header.raw_len == len(raw)
    assert header.header_len == header_length(len(KEY), 8) >= HEADER_FIXED + len(KEY)
    assert header.total_len == len(frame)


def test_page_aligned_header_for_o_direct() -> None:
    frame, raw = _frame(CodecId.NONE, align=4096)
    assert parse_header(frame).header_len == 4096
    assert frame[4096:] == raw


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda f: f[:-1], id="truncated"),
        pytest.param(lambda f: f[:40], id="truncated-header"),
        pytest.param(lambda f: f[:-1] + bytes([f[-1] ^ 0x01]), id="payload-bitflip"),
        pytest.param(lambda f: b"XXXX" + f[4:], id="bad-magic"),
        pytest.param(lambda f: bytes(len(f)), id="zeroed"),
        pytest.param(lambda f: f + b"\0", id="trailing-bytes"),
    ],
)
def test_damaged_frames_are_corrupt(mutate) -> None:
    frame, raw = _frame()
    with pytest.raises(ObjectCorrupt):
        dest = memoryview(bytearray(len(raw)))
        FrameCodec(NS, CodecId.NONE).decode_into(KEY, mutate(frame), dest)


def test_other_key_other_namespace_other_length_are_corrupt() -> None:
    frame, raw = _frame()
    dest = memoryview(bytearray(len(raw)))
    with pytest.raises(ObjectCorrupt, match="another key"):
        FrameCodec(NS, CodecId.NONE).decode_into(b"\x02" * 36, frame, dest)
    with pytest.raises(ObjectCorrupt, match="another namespace"):
        FrameCodec(b"M" * 16, CodecId.NONE).decode_into(KEY, frame, dest)
    with pytest.raises(ObjectCorrupt):
        FrameCodec(NS, CodecId.NONE).decode_into(KEY, frame, memoryview(bytearray(len(raw) * 2)))


def test_a_store_batch_fails_only_the_rows_that_could_not_be_encoded() -> None:
    """The core's store batch: one bad row is its own error, its neighbours are written."""
    from kvstore_tiers.backends.base import Backend
    from kvstore_tiers.batching import StoreItem, store_many
    from kvstore_tiers.errors import ObjectMissing
    from kvstore_tiers.namespace import Namespace

    class Dict(Backend):
        """The byte contract's required methods over a dict: the default batch calls."""

        name = "dict"

        def __init__(self) -> None:
            super().__init__(None, Namespace.from_run_config({"model_name": "batch"}))
            self.objects: dict[str, bytes] = {}

        def put(self, name, parts):  # type: ignore[no-untyped-def]
            if name in self.objects:
                return False
            self.objects[name] = b"".join(bytes(p) for p in parts)
            return True

        def get(self, name):  # type: ignore[no-untyped-def]
            if name not in self.objects:
                raise ObjectMissing(name)
            return self.objects[name]

        def exists_many(self, names):  # type: ignore[no-untyped-def]
            return [n in self.objects for n in names]

        def delete(self, name):  # type: ignore[no-untyped-def]
            self.objects.pop(name, None)

        def iter_objects(self, prefix=""):  # type: ignore[no-untyped-def]
            return iter(())

    backend = Dict()
    raw = memoryview(bytes(range(256)) * 32)
    items = [StoreItem("a", KEY, raw), StoreItem("b", KEY, None),  # type: ignore[arg-type]
             StoreItem("c", KEY, raw)]
    out = store_many(backend, items, FrameCodec(NS, CodecId.NONE))
    assert out[0] == out[2] == header_length(len(KEY), 8) + len(raw)
    assert isinstance(out[1], Exception)
    assert backend.exists_many(["a", "b", "c"]) == [True, False, True]


def scatter(data: bytes, parts: tuple[memoryview, ...]) -> int:
    """What a backend's scatter read does: ``data`` from its start into ``parts``."""
    pos = 0
    for part in parts:
        take = max(0, min(len(part), len(data) - pos))
        part[:take] = data[pos:pos + take]
        pos += take
    return pos


def _scattered(frame: bytes, codec: FrameCodec, dest: memoryview) -> tuple[FrameRead, int]:
    """``frame`` read as its plan says (the bytes from its start into the parts)."""
    (plan,) = codec.plan_reads([KEY], [dest])
    return plan, scatter(frame, plan.parts)


@pytest.mark.parametrize("align", [8, 4096])
@pytest.mark.parametrize("codec", list(CodecId))
def test_a_planned_read_lands_as_a_whole_frame_decodes(codec: CodecId, align: int) -> None:
    """A frame scattered into its plan's buffers finishes into the row exactly as a
    whole-frame decode does; a raw payload lands in the row itself."""
    from kvstore_tiers.frame import created_ms

    frame, raw = _frame(codec, align)
    reader = FrameCodec(NS, codec, align)
    dest = memoryview(bytearray(len(raw)))
    plan, placed = _scattered(frame, reader, dest)
    assert plan.parts[1] is dest and len(plan.parts[0]) == header_length(len(KEY), align)
    assert plan.crc_part == (1 if codec == CodecId.NONE else None)
    assert placed == len(frame)
    assert plan.finish(placed, len(frame)) == checksum(raw)
    assert bytes(dest) == raw
    assert created_ms(frame[:HEADER_FIXED]) > 0


def test_a_planned_read_checks_before_it_trusts_the_row() -> None:
    frame, raw = _frame()
    codec = FrameCodec(NS, CodecId.NONE)
    dest = memoryview(bytearray(len(raw)))
    plan, placed = _scattered(frame[:-1], codec, dest)
    with pytest.raises(ObjectCorrupt, match="frame says"):
        plan.finish(placed, len(frame) - 1)
    (other,) = codec.plan_reads([b"\x02" * 36], [dest])
    scatter(frame, other.parts)
    with pytest.raises(ObjectCorrupt, match="another key"):
        other.finish(len(frame), len(frame))
    plan, placed = _scattered(frame[:40], codec, dest)
    with pytest.raises(ObjectCorrupt, match="shorter than a frame header"):
        plan.finish(placed, 40)
    flipped = bytearray(frame)
    flipped[-1] ^= 1
    plan, placed = _scattered(bytes(flipped), codec, dest)
    with pytest.raises(ObjectCorrupt, match="checksum"):
        plan.finish(placed, len(frame))


def test_an_object_longer_than_its_plan_is_unplanned_and_a_foreign_padding_still_loads() -> None:
    """A frame padded to a page, read by a tier that pads to 8: longer than the
    plan (Unplanned: the caller reads it whole, and it decodes); one padded to 8,
    read by a tier that pads to a page: it fits, and its payload is gathered."""
    frame, raw = _frame(CodecId.NONE, align=4096)
    narrow = FrameCodec(NS, CodecId.NONE, 8)
    dest = memoryview(bytearray(len(raw)))
    plan, placed = _scattered(frame, narrow, dest)
    assert placed < len(frame)
    with pytest.raises(Unplanned):
        plan.finish(placed, len(frame))
    narrow.decode_into(KEY, frame, dest)
    assert bytes(dest) == raw
    frame, raw = _frame(CodecId.NONE, align=8)
    dest = memoryview(bytearray(len(raw)))
    plan, placed = _scattered(frame, FrameCodec(NS, CodecId.NONE, 4096), dest)
    assert plan.finish(placed, len(frame)) == checksum(raw)
    assert bytes(dest) == raw


def test_a_raw_payload_checksummed_by_its_reader_is_compared_not_recomputed() -> None:
    """finish(crc): the reader's CRC-32C of the row (the fs tier's GIL-free read)
    decides; a wrong one is ObjectCorrupt even over right bytes, so a row is
    accepted only on the checksum of what was read into it."""
    import crc32c

    frame, raw = _frame()
    codec = FrameCodec(NS, CodecId.NONE)
    for given, ok in ((crc32c.crc32c(raw), True), (crc32c.crc32c(raw) ^ 1, False)):
        dest = memoryview(bytearray(len(raw)))
        plan, placed = _scattered(frame, codec, dest)
        if ok:
            plan.finish(placed, len(frame), given)
            assert bytes(dest) == raw
        else:
            with pytest.raises(ObjectCorrupt, match="checksum"):
                plan.finish(placed, len(frame), given)


def test_created_ms_of_a_non_frame_is_none() -> None:
    from kvstore_tiers.frame import created_ms

    frame, _raw = _frame()
    assert created_ms(frame[:HEADER_FIXED - 1]) is None
    assert created_ms(b"XXXX" + frame[4:HEADER_FIXED]) is None


@pytest.mark.parametrize("codec", list(CodecId))
def test_verify_frame_runs_the_load_checks(codec: CodecId) -> None:
    from kvstore_tiers.frame import verify_frame

    frame, raw = _frame(codec)
    header = verify_frame(frame, KEY, NS[:6])
    assert header.raw_len == len(raw) and header.key == KEY
    with pytest.raises(ObjectCorrupt, match="another key"):
        verify_frame(frame, b"\x02" * 36)
    with pytest.raises(ObjectCorrupt, match="another namespace"):
        verify_frame(frame, KEY, b"M" * 6)
    with pytest.raises(ObjectCorrupt):
        verify_frame(frame[:-1], KEY)
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    with pytest.raises(ObjectCorrupt):
        verify_frame(bytes(damaged), KEY)


def test_a_load_returns_the_checksum_it_verified_and_a_store_takes_a_given_one() -> None:
    """What read-through relies on: the CRC-32C a load verified (None for an
    encrypted frame), and a frame built with the CRC its caller computed."""
    frame, raw = _frame()
    codec = FrameCodec(NS, CodecId.NONE)
    header = codec.decode_into(KEY, frame, memoryview(bytearray(len(raw))))
    assert header.row_checksum == checksum(raw)
    assert header._replace(flags=FLAG_ENCRYPTED).row_checksum is None
    plan, placed = _scattered(frame, codec, memoryview(bytearray(len(raw))))
    assert plan.finish(placed, len(frame)) == checksum(raw)
    zstd = FrameCodec(NS, CodecId.ZSTD)
    zframe = b"".join(bytes(b) for b in zstd.encode(KEY, memoryview(raw)))
    plan, placed = _scattered(zframe, zstd, memoryview(bytearray(len(raw))))
    assert plan.finish(placed, len(zframe)) == checksum(raw)
    given, _ = codec.encode(KEY, memoryview(raw), 12345)
    assert parse_header(given).checksum == 12345


def test_an_unsummed_frame_leaves_its_checksum_to_the_writer() -> None:
    """``unsummed``: the header's checksum field (at CHECKSUM_AT, 8 bytes) is
    zero until the writer puts the row's CRC-32C there; the frame is corrupt
    before and whole after. A known checksum wins; a payload that is not the
    row (compressed) cannot be left to its writer."""
    raw = np.random.default_rng(3).integers(0, 4, 8192, dtype=np.uint8).tobytes()
    codec = FrameCodec(NS, CodecId.NONE, 4096)
    header, payload = codec.encode(KEY, memoryview(raw), unsummed=True)
    assert bytes(header[CHECKSUM_AT:CHECKSUM_AT + 8]) == bytes(8)
    dest = memoryview(bytearray(len(raw)))
    with pytest.raises(ObjectCorrupt):
        codec.decode_into(KEY, bytes(header) + bytes(payload), dest)
    header[CHECKSUM_AT:CHECKSUM_AT + 4] = checksum(raw).to_bytes(4, "little")
    assert codec.decode_into(KEY, bytes(header) + bytes(payload), dest).checksum == checksum(raw)
    assert bytes(dest) == raw
    known, _ = codec.encode(KEY, memoryview(raw), 777, unsummed=True)
    assert parse_header(known).checksum == 777
    with pytest.raises(ValueError):
        FrameCodec(NS, CodecId.ZSTD).encode(KEY, memoryview(raw), unsummed=True)


def test_a_listing_head_holds_what_created_ms_reads() -> None:
    """A store without write times lists LISTING_HEAD bytes of each object; the
    core reads the writer's clock from them."""
    from kvstore_tiers.backends.base import LISTING_HEAD
    from kvstore_tiers.frame import created_ms

    frame, _raw = _frame()
    assert HEADER_FIXED <= LISTING_HEAD
    assert created_ms(frame[:LISTING_HEAD]) == parse_header(frame).created_ms


def test_an_object_longer_than_its_plan_is_corrupt_unless_its_header_is_this_frames() -> None:
    """Longer than the plan, yet read again whole only when its checked header (this
    key, this namespace, this row, its own size) says a writer padded it further: a
    foreign frame with a tail of garbage, or one of this tier's headers over more
    bytes than its frame has, is corrupt at once."""
    frame, raw = _frame(CodecId.NONE, align=8)
    codec = FrameCodec(NS, CodecId.NONE, 8)
    dest = memoryview(bytearray(len(raw)))
    foreign = b"\x02" * 36
    header, payload = FrameCodec(NS, CodecId.NONE, 4096).encode(foreign, memoryview(raw))
    padded_foreign = bytes(header) + bytes(payload)
    (plan,) = codec.plan_reads([KEY], [dest])
    placed = scatter(padded_foreign, plan.parts)
    assert placed < len(padded_foreign)
    with pytest.raises(ObjectCorrupt, match="another key"):
        plan.finish(placed, len(padded_foreign))
    longer = frame + bytes(1 << 20)
    plan, placed = _scattered(longer, codec, dest)
    with pytest.raises(ObjectCorrupt, match="frame says"):
        plan.finish(placed, len(longer))
