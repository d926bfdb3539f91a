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


def test_encode_batch_reports_failed_items_and_encodes_the_rest() -> None:
    """Batched stores (s3, redis) fail only the rows that could not be encoded."""
    from kvstore_tiers.backends.base import StoreItem
    from kvstore_tiers.batching import encode_batch
    from kvstore_tiers.errors import TransientError

    raw = memoryview(bytes(range(256)) * 32)
    items = [StoreItem("a", KEY, raw), StoreItem("b", KEY, None),  # type: ignore[arg-type]
             StoreItem("c", KEY, raw)]
    out, encoded = encode_batch(items, FrameCodec(NS, CodecId.NONE))
    assert [i for i, _h, _p in encoded] == [0, 2]
    assert isinstance(out[1], TransientError)
    assert [len(h) + len(p) for _i, h, p in encoded] == [header_length(len(KEY), 8) + len(raw)] * 2


@pytest.mark.parametrize("codec", list(CodecId))
@pytest.mark.parametrize("head_len", [0, 40, 200, 4000, None])
def test_receive_header_first_into_row_or_scratch(codec: CodecId, head_len: int | None) -> None:
    """A frame read header first lands in the row exactly as a whole-frame decode."""
    from kvstore_tiers.frame import created_ms

    frame, raw = _frame(codec)
    hlen = parse_header(frame).header_len
    head = frame[: hlen + (head_len or 0)] if head_len is not None else frame
    dest = memoryview(bytearray(len(raw)))
    scratch_calls: list[int] = []

    def scratch(n: int) -> memoryview:
        scratch_calls.append(n)
        return memoryview(bytearray(n + 7))

    rx = FrameCodec(NS, codec).receive(KEY, head, len(frame), dest, scratch)
    assert rx.offset == len(head)
    assert len(rx.remaining) == len(frame) - len(head)
    raw_payload = rx.header.codec == CodecId.NONE
    assert rx.direct == raw_payload
    if raw_payload:
        assert rx.remaining.obj is dest.obj and not scratch_calls
    if len(rx.remaining):  # (an empty view of a read-only head cannot be assigned to)
        rx.remaining[:] = frame[len(head):]
    rx.finish()
    assert bytes(dest) == raw
    assert created_ms(frame[:HEADER_FIXED]) == rx.header.created_ms > 0


def test_receive_rejects_before_touching_the_row() -> None:
    frame, raw = _frame()
    dest = memoryview(bytearray(b"\xaa" * len(raw)))
    codec = FrameCodec(NS, CodecId.NONE)
    with pytest.raises(ObjectCorrupt, match="frame says"):
        codec.receive(KEY, frame[:200], len(frame) - 1, dest)
    with pytest.raises(ObjectCorrupt, match="another key"):
        codec.receive(b"\x02" * 36, frame[:200], len(frame), dest)
    with pytest.raises(ObjectCorrupt, match="longer than the bytes read"):
        codec.receive(KEY, frame[:HEADER_FIXED + len(KEY)], len(frame), dest)
    assert bytes(dest) == b"\xaa" * len(raw)
    rx = codec.receive(KEY, frame[:200], len(frame), dest)
    rx.remaining[:] = frame[200:]
    rx.remaining[-1] ^= 1
    with pytest.raises(ObjectCorrupt, match="checksum"):
        rx.finish()


def test_a_raw_payload_checksummed_by_its_reader_is_compared_not_recomputed() -> None:
    """finish(dest_checksum): the reader's CRC-32C of the row (the fs tier's
    GIL-free read) decides; a wrong one is ObjectCorrupt even over right bytes,
    so a row is accepted only on the checksum of what was read into it."""
    import crc32c

    frame, raw = _frame()
    codec = FrameCodec(NS, CodecId.NONE)
    for given, ok in ((crc32c.crc32c(raw), True), (crc32c.crc32c(raw) ^ 1, False)):
        dest = memoryview(bytearray(len(raw)))
        rx = codec.receive(KEY, frame[:200], len(frame), dest)
        rx.remaining[:] = frame[200:]
        if ok:
            rx.finish(given)
            assert bytes(dest) == raw
        else:
            with pytest.raises(ObjectCorrupt, match="checksum"):
                rx.finish(given)


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
    rx = codec.receive(KEY, frame[:256], len(frame), memoryview(bytearray(len(raw))))
    rx.remaining[:] = frame[rx.offset:]
    assert rx.finish() == checksum(raw)
    zstd = FrameCodec(NS, CodecId.ZSTD)
    zframe = b"".join(bytes(b) for b in zstd.encode(KEY, memoryview(raw)))
    assert zstd.receive(KEY, zframe, len(zframe), memoryview(bytearray(len(raw)))).finish() \
        == checksum(raw)
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
