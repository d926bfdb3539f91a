"""The self-describing, checksummed frame every stored object is wrapped in.

Layout (little-endian), ``HEADER_FIXED`` = 64 bytes followed by the key::

    off  size  field
      0     4  magic            b"KVTF"
      4     2  format version   1
      6     1  codec            CodecId (0 none, 1 zstd, 2 kvsplit)
      7     1  flags            bit 0: payload encrypted (kvstore_tiers.crypto); others 0
      8     4  header_len       bytes before the payload (fixed + key + padding)
     12     2  key_len          length of the block key that follows
     14     2  reserved         0
     16     8  raw_len          length of the raw KV row
     24     8  stored_len       length of the payload as stored
     32     8  checksum         CRC-32C of the raw row (before encoding), zero-extended
     40    16  namespace        first 16 bytes of the namespace digest
     56     8  created_ms       writer's wall clock, ms since the epoch
     64     *  key              the vLLM OffloadKey (block hash + group index)
      *     *  padding          zeros up to header_len
            *  payload          stored_len bytes

``header_len`` is the writer's: fs pads to a page, so a raw payload reads
with O_DIRECT straight into a page-aligned row; remote backends pad to 8.

Encrypted frames (flag bit 0, still format version 1): the payload is
``nonce || AES-GCM(compressed payload) || tag`` with the namespace, key,
codec and raw length as AAD, and ``checksum`` is 0 (the tag authenticates; a
CRC of the plaintext would leak its fingerprint). A reader with a key rejects
unencrypted frames: whoever can write the store cannot plant clear blocks. :func:`parse_header`
reports an encrypted frame's ``codec`` as ``codec | CODEC_ENCRYPTED``, so
backend fast paths that special-case ``CodecId.NONE`` (reading a raw payload
straight into the row) never treat ciphertext as a row.

A reader checks every field (magic, version, codec, lengths, key, namespace)
and the decoded bytes' checksum; any mismatch is
:class:`~kvstore_tiers.errors.ObjectCorrupt`: wrong bytes are never loaded.

This module is the only one that reads or writes a frame. What the others call:

* :meth:`FrameCodec.encode` -- a row into ``(header, payload)`` (stores);
* :data:`CHECKSUM_AT` -- where a writer that checksums the row as it writes
  it puts the CRC (:class:`~kvstore_tiers.backends.base.Write`);
* :meth:`FrameCodec.plan_reads` -- a batch of loads planned as scatter reads:
  the buffers a backend fills with each object's bytes (a header's worth, the
  row itself, a tail), then :meth:`FrameRead.finish` checks the header and
  verifies the row in place or decodes the payload into it. The backend
  moves bytes; it never sees a header;
* :meth:`FrameCodec.decode_into` -- a whole frame into a row (an object that
  did not fit its plan, and operators' tools);
* :func:`verify_frame` -- the load's checks for an operator's ``verify``;
* :func:`created_ms` -- the writer's clock from an object's first bytes.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import crc32c

from kvstore_tiers.codecs import CodecId, CodecSet
from kvstore_tiers.errors import ObjectCorrupt

if TYPE_CHECKING:
    from kvstore_tiers.crypto import PayloadCipher

MAGIC = b"KVTF"
VERSION = 1
NAMESPACE_DIGEST_BYTES = 16
_FIXED = struct.Struct("<4sHBBIHHQQQ16sQ")
HEADER_FIXED = _FIXED.size  # 64
#: The checksum's offset (the layout above): an ``unsummed`` frame's writer puts it there.
CHECKSUM_AT = struct.calcsize("<4sHBBIHHQQ")
#: Bytes a load reads past the end of a planned frame (its header and row):
#: an encrypted frame's nonce and tag, or a header padded further than this
#: tier pads, still arrive in the one read (:meth:`FrameCodec.plan_reads`).
TAIL_READ = 256
assert HEADER_FIXED == 64
#: Flags byte: the payload is AES-GCM sealed.
FLAG_ENCRYPTED = 0x01
_KNOWN_FLAGS = FLAG_ENCRYPTED
#: Added to ``FrameHeader.codec`` of encrypted frames (not a stored value).
CODEC_ENCRYPTED = 0x100


def checksum(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``: the frame's payload checksum.

    Why CRC-32C rather than xxh3: the ``crc32c`` package uses the CPU's CRC
    instruction *and releases the GIL* while it runs, whereas python-xxhash
    holds it; checksums run on the I/O threads for every block, and holding
    the GIL there would stall vLLM's scheduler thread.
    """
    return crc32c.crc32c(data)


class FrameHeader(NamedTuple):
    """A parsed frame header (a NamedTuple: one is parsed per block loaded,
    holding the GIL, and it builds several times faster than a dataclass)."""

    codec: int
    header_len: int
    raw_len: int
    stored_len: int
    checksum: int
    namespace: bytes
    created_ms: int
    key: bytes
    flags: int = 0

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    @property
    def row_checksum(self) -> int | None:
        """The raw row's CRC-32C; None when encrypted (the tag authenticates)."""
        return None if self.flags & FLAG_ENCRYPTED else self.checksum

    @property
    def total_len(self) -> int:
        return self.header_len + self.stored_len


def header_length(key_len: int, align: int) -> int:
    """Header length for a key of ``key_len`` bytes, padded to ``align``."""
    n = HEADER_FIXED + key_len
    return (n + align - 1) // align * align


def pack_header(*, codec: CodecId, key: bytes, namespace: bytes, raw_len: int, stored_len: int,
                raw_checksum: int, align: int = 8, created_ms: int | None = None,
                flags: int = 0) -> bytearray:
    """Build a header (padded to ``align``) for a payload."""
    if len(namespace) != NAMESPACE_DIGEST_BYTES:
        raise ValueError("namespace digest must be 16 bytes")
    hlen = header_length(len(key), align)
    buf = bytearray(hlen)
    _FIXED.pack_into(
        buf, 0, MAGIC, VERSION, int(codec), flags, hlen, len(key), 0,
        raw_len, stored_len, raw_checksum, namespace,
        int(time.time() * 1000) if created_ms is None else created_ms,
    )
    buf[HEADER_FIXED : HEADER_FIXED + len(key)] = key
    return buf


def parse_header(buf: bytes | memoryview) -> FrameHeader:
    """Parse the header at the start of ``buf``; raises ObjectCorrupt if it is not one."""
    if len(buf) < HEADER_FIXED:
        raise ObjectCorrupt(f"object of {len(buf)} bytes is shorter than a frame header")
    (magic, version, codec, flags, hlen, key_len, _r, raw_len, stored_len, csum, ns,
     created) = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ObjectCorrupt("not a kvstore-tiers frame (bad magic)")
    if version != VERSION:
        raise ObjectCorrupt(f"unsupported frame version {version}")
    if hlen < HEADER_FIXED + key_len or len(buf) < HEADER_FIXED + key_len:
        raise ObjectCorrupt("truncated frame header")
    if flags & ~_KNOWN_FLAGS:
        raise ObjectCorrupt(f"unknown frame flags {flags:#x}")
    if flags & FLAG_ENCRYPTED:
        codec |= CODEC_ENCRYPTED
    key = bytes(buf[HEADER_FIXED : HEADER_FIXED + key_len])
    return FrameHeader(codec, hlen, raw_len, stored_len, csum, ns, created, key, flags)


def created_ms(head: bytes | bytearray | memoryview) -> int | None:
    """The writer's ``created_ms`` from a frame's first :data:`HEADER_FIXED` bytes.

    ``None`` when ``head`` is not the start of a frame of this format (too
    short, bad magic or version): a listing reads only the fixed part, so the
    key and payload are not checked here.
    """
    if len(head) < HEADER_FIXED:
        return None
    fields = _FIXED.unpack_from(head, 0)
    if fields[0] != MAGIC or fields[1] != VERSION:
        return None
    return int(fields[11])


def check_header(header: FrameHeader, *, key: bytes, namespace: bytes, raw_len: int) -> None:
    """Raise ObjectCorrupt unless ``header`` is the frame of ``key`` in ``namespace``."""
    if header.namespace != namespace:
        raise ObjectCorrupt("frame belongs to another namespace")
    if header.key != key:
        raise ObjectCorrupt("frame belongs to another key")
    if header.raw_len != raw_len:
        raise ObjectCorrupt(f"frame holds {header.raw_len} raw bytes, expected {raw_len}")
    if header.codec == CodecId.NONE and header.stored_len != raw_len:
        raise ObjectCorrupt("raw frame has a payload of the wrong length")


class FrameCodec:
    """Encodes rows into frames and decodes frames into rows, for one thread.

    ``encode`` returns ``(header, payload)`` as two buffers so a backend can
    write them with one vectored call and no concatenation copy.
    """

    def __init__(self, namespace: bytes, codec: CodecId, header_align: int = 8,
                 cipher: PayloadCipher | None = None) -> None:
        self.namespace = namespace
        self.codec = codec
        self.header_align = header_align
        self.cipher = cipher
        self._codecs = CodecSet()
        self._scratch: mmap.mmap | None = None  # plan_reads' header and tail buffers

    @property
    def raw_payloads(self) -> bool:
        """Whether the frames this codec writes carry the row as is (no codec, no
        cipher). A reader of this tier's frames may then checksum a payload as it
        lands in the row and hand the result to :meth:`FrameReceiver.finish`;
        for any other payload such a checksum would be work for nothing."""
        return self.codec == CodecId.NONE and self.cipher is None

    def encode(self, key: bytes, raw: memoryview, raw_checksum: int | None = None, *,
               unsummed: bool = False) -> tuple[bytearray, bytes | memoryview]:
        """``raw`` into ``(header, payload)``; ``raw_checksum``: ``raw``'s CRC-32C
        if the caller computed it over these very bytes. ``unsummed`` (where
        :attr:`raw_payloads` only) leaves the checksum to the writer, which must
        put the payload's CRC-32C at :data:`CHECKSUM_AT`, else the frame is corrupt."""
        if unsummed and raw_checksum is None:
            if not self.raw_payloads:
                raise ValueError("only a raw payload's writer can checksum it")
            raw_checksum = 0
        codec, payload = self._codecs.encode(self.codec, raw)
        if self.cipher is not None:
            # Encrypt after compression; the GCM tag replaces the CRC.
            payload = self.cipher.seal(
                self.cipher.aad(self.namespace, key, int(codec), len(raw)), payload)
            header = pack_header(
                codec=codec, key=key, namespace=self.namespace, raw_len=len(raw),
                stored_len=len(payload), raw_checksum=0, align=self.header_align,
                flags=FLAG_ENCRYPTED,
            )
            return header, payload
        raw_sum = checksum(raw) if raw_checksum is None else raw_checksum
        header = pack_header(
            codec=codec, key=key, namespace=self.namespace, raw_len=len(raw),
            stored_len=len(payload), raw_checksum=raw_sum, align=self.header_align,
        )
        return header, payload

    def decode_into(self, key: bytes, frame: bytes | memoryview, dest: memoryview) -> FrameHeader:
        """Decode a whole frame (header + payload) of ``key`` into ``dest``.

        On success ``dest`` holds the verified raw bytes. On
        :class:`ObjectCorrupt` ``dest`` may hold garbage and must not be used.
        """
        header = self._checked_header(key, frame, len(frame), len(dest))
        self.decode_payload_into(header, memoryview(frame)[header.header_len:], dest)
        return header

    def plan_reads(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[FrameRead]:
        """Plan the loads of the frames of ``keys`` into the rows ``dests`` as
        scatter reads, one :class:`FrameRead` each.

        Each read's buffers are a header's worth (this tier's header of that
        key), the row itself, and :data:`TAIL_READ` bytes (at least the header
        alignment): a raw frame lands with its payload in the row, and any
        frame of this key and row length lands whole. The header and tail
        buffers are this codec's (its thread's), page aligned where the
        header alignment is a page, and reused by the next call: finish every
        read before planning more on the same thread."""
        align = self.header_align
        tail = max(TAIL_READ, align)
        heads = [header_length(len(k), align) for k in keys]
        arena = self._arena(sum(heads) + tail * len(keys))
        reads: list[FrameRead] = []
        pos = 0
        for key, dest, hlen in zip(keys, dests, heads, strict=True):
            parts = (arena[pos:pos + hlen], dest, arena[pos + hlen:pos + hlen + tail])
            reads.append(FrameRead(self, key, parts))
            pos += hlen + tail
        return reads

    def _arena(self, n: int) -> memoryview:
        """This codec's scratch of at least ``n`` bytes, page aligned (anonymous
        mmap memory is, so direct I/O into it works as into the rows)."""
        if self._scratch is None or len(self._scratch) < n:
            # The old map is dropped, not closed: a view of it may still be alive.
            self._scratch = mmap.mmap(-1, max(n, mmap.PAGESIZE))
        return memoryview(self._scratch)

    def _checked_header(self, key: bytes, head: bytes | memoryview, size: int,
                        raw_len: int) -> FrameHeader:
        """The header at the start of ``head`` of an object of ``size`` bytes,
        checked as the frame of ``key`` with a row of ``raw_len`` bytes that this
        codec can read (encrypted exactly when it has a cipher)."""
        header = parse_header(head)
        check_header(header, key=key, namespace=self.namespace, raw_len=raw_len)
        if size != header.total_len:
            raise ObjectCorrupt(f"object is {size} bytes, frame says {header.total_len}")
        if header.encrypted != (self.cipher is not None):
            raise ObjectCorrupt("encrypted frame but no key configured" if header.encrypted
                                else "unencrypted frame in an encrypted tier")
        return header

    def decode_payload_into(
        self, header: FrameHeader, payload: bytes | memoryview, dest: memoryview
    ) -> None:
        """Decode a checked header's payload into ``dest`` and verify its checksum.

        ``payload`` may be a view of ``dest`` itself (a compressed or sealed
        payload read into the row): the codecs and the cipher read it whole
        before they write the row. With a cipher configured only encrypted
        frames are accepted (and vice versa); authentication failure is
        ObjectCorrupt.
        """
        if header.encrypted != (self.cipher is not None):
            raise ObjectCorrupt("encrypted frame but no key configured" if header.encrypted
                                else "unencrypted frame in an encrypted tier")
        if self.cipher is None:
            self._codecs.decode_into(header.codec, payload, dest)
            self.verify(header, dest)
            return
        codec = header.codec & ~CODEC_ENCRYPTED
        plain = self.cipher.open(
            self.cipher.aad(self.namespace, header.key, codec, header.raw_len), payload)
        self._codecs.decode_into(codec, plain, dest)

    @staticmethod
    def verify(header: FrameHeader, dest: memoryview, dest_checksum: int | None = None) -> None:
        """Raise ObjectCorrupt unless ``dest`` (whose CRC-32C, if the caller
        computed it, is ``dest_checksum``) matches the header's checksum."""
        if header.encrypted:  # only reached through a raw fast path: never valid
            raise ObjectCorrupt("encrypted frame on a raw read path")
        if (checksum(dest) if dest_checksum is None else dest_checksum) != header.checksum:
            raise ObjectCorrupt("checksum mismatch")


class Unplanned(Exception):
    """The frame is longer than its read plan: its header (checked: this key,
    this namespace, this row length, the object's size) is padded further than
    this tier pads its own. The caller reads it whole
    (:meth:`FrameCodec.decode_into`)."""


class FrameRead:
    """One frame's load planned as a scatter read (:meth:`FrameCodec.plan_reads`).

    A backend fills ``parts`` -- the header's buffer, the row ``dest``, a
    tail -- with the object's bytes from its start, then :meth:`finish`
    checks and verifies. ``crc_part`` (the row, for a tier whose frames carry
    rows as they are; else None) is the part whose CRC-32C the reader may
    compute while the bytes are hot and hand to :meth:`finish`.
    """

    __slots__ = ("_codec", "crc_part", "dest", "key", "parts")

    def __init__(self, codec: FrameCodec, key: bytes,
                 parts: tuple[memoryview, memoryview, memoryview]) -> None:
        self._codec = codec
        self.key = key
        self.parts = parts
        self.dest = parts[1]
        self.crc_part = 1 if codec.raw_payloads else None

    def finish(self, placed: int, size: int, crc: int | None = None) -> int | None:
        """The read put ``placed`` bytes of an object of ``size`` into the parts
        (``crc``: the row part's CRC-32C, if the reader computed it): check the
        header, then verify the row in place (a raw payload where the plan put
        it) or decode the payload into it. Returns the row's CRC-32C
        (:attr:`FrameHeader.row_checksum`).

        Raises :class:`ObjectCorrupt` for anything but this key's frame in
        this namespace (``dest`` is then unusable), :class:`Unplanned` for a
        frame of this key longer than the parts (its header says so) because
        its writer padded the header further than this tier does."""
        head, dest = self.parts[0], self.dest
        codec = self._codec
        if placed > size:
            raise ObjectCorrupt(f"read placed {placed} bytes of an object of {size}")
        # The header first, whatever the object's length: only this key's frame,
        # whole, in this namespace, padded further than planned is read again.
        header = codec._checked_header(self.key, head[:placed], size, len(dest))
        hlen = header.header_len
        if placed < size:
            if hlen == len(head):  # as planned, yet longer than any frame of this row
                raise ObjectCorrupt(f"object of {size} bytes is longer than its frame")
            raise Unplanned(f"frame of {size} bytes is longer than its read plan")
        if hlen == len(head):
            if header.codec == CodecId.NONE:  # the row is in place: verify it
                codec.verify(header, dest, crc)
                return header.checksum
            if header.stored_len <= len(dest):  # the payload is in the row: decode in place
                codec.decode_payload_into(header, dest[:header.stored_len], dest)
                return header.row_checksum
        codec.decode_payload_into(header, self._gather(hlen, size), dest)
        return header.row_checksum

    def _gather(self, start: int, stop: int) -> memoryview:
        """A copy of the object's bytes ``[start, stop)`` from the parts (a
        payload that straddles them: an encrypted raw row, a foreign header)."""
        out = memoryview(bytearray(stop - start))
        pos = got = 0
        for part in self.parts:
            lo, hi = max(start, pos), min(stop, pos + len(part))
            if lo < hi:
                out[got:got + hi - lo] = part[lo - pos:hi - pos]
                got += hi - lo
            pos += len(part)
        return out


def verify_frame(frame: bytes | bytearray | memoryview, key: bytes,
                 namespace_prefix: bytes = b"") -> FrameHeader:
    """Check one whole stored frame of ``key`` as a load does; returns its header.

    For an operator's ``verify``, which knows an object's name (its key and
    the first bytes of its namespace digest, ``namespace_prefix``) but not the
    tier's namespace or key: the payload goes through :meth:`FrameCodec.decode_into`
    into a scratch row; an encrypted frame is checked up to its payload. Any
    failure, a codec library's error on garbage included, is ObjectCorrupt.
    """
    header = parse_header(frame)
    if header.key != key:
        raise ObjectCorrupt("frame belongs to another key")
    if not header.namespace.startswith(namespace_prefix):
        raise ObjectCorrupt("frame belongs to another namespace")
    if len(frame) != header.total_len:
        raise ObjectCorrupt(f"object is {len(frame)} bytes, frame says {header.total_len}")
    if header.encrypted:
        return header
    dest = memoryview(bytearray(header.raw_len))
    try:
        FrameCodec(header.namespace, CodecId.NONE).decode_into(key, frame, dest)
    except ObjectCorrupt:
        raise
    except Exception as exc:
        raise ObjectCorrupt(f"payload does not decode: {exc}") from None
    return header
