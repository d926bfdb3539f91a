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
* :data:`CHECKSUM_AT` -- where the fs publish call puts the CRC it computed of a raw row;
* :meth:`FrameCodec.decode_into` -- a whole frame into a row (backends that
  get an object in one piece: s3, redis pipelines, the memory plugin);
* :meth:`FrameCodec.receive` -- a frame read header first (fs, the redis fast
  path): it checks the header and says where the rest of the payload goes
  (straight into the row when it is raw); :meth:`FrameReceiver.finish` then
  verifies or decodes. ``decode_into`` is ``receive`` + ``finish``, so every
  load runs the same checks;
* :func:`verify_frame` -- the load's checks for an operator's ``verify``;
* :func:`created_ms` -- the writer's clock from an object's first bytes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
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
#: Bytes a remote reader takes first (:meth:`FrameCodec.receive`): a whole
#: header padded to at most 64 bytes is in them (the fs tier reads a page).
FIRST_READ = 256
#: Bytes of an object that :func:`created_ms` needs (a listing reads no more).
LISTING_READ = HEADER_FIXED
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
        receiver = self.receive(key, frame, len(frame), dest)
        receiver.finish()
        return receiver.header

    def receive(self, key: bytes, head: bytes | bytearray | memoryview, size: int,
                dest: memoryview, scratch: Callable[[int], memoryview] | None = None,
                ) -> FrameReceiver:
        """Start receiving the frame of ``key``, of ``size`` bytes, into ``dest``.

        ``head`` is the object's first bytes (at least its whole header; any
        payload bytes after it are used too). The header is parsed and checked
        here (magic, version, key, namespace, lengths, encryption); a mismatch
        raises :class:`ObjectCorrupt` before any byte lands in ``dest``. The
        returned receiver says where the rest goes: ``remaining`` (exactly the
        bytes at object offset ``offset`` to the end) is a view of ``dest``
        itself for a raw payload (``direct``), else of ``scratch(stored_len)``
        (a fresh bytearray without ``scratch``). Fill it, then call
        :meth:`FrameReceiver.finish`.
        """
        header = parse_header(head)
        check_header(header, key=key, namespace=self.namespace, raw_len=len(dest))
        if size != header.total_len or len(head) > size:
            raise ObjectCorrupt(f"object is {size} bytes, frame says {header.total_len}")
        hlen = header.header_len
        if hlen > len(head):
            raise ObjectCorrupt("frame header is longer than the bytes read before the payload")
        if header.encrypted != (self.cipher is not None):
            raise ObjectCorrupt("encrypted frame but no key configured" if header.encrypted
                                else "unencrypted frame in an encrypted tier")
        in_head = len(head) - hlen  # payload bytes already read with the header
        view = memoryview(head)
        direct = header.codec == CodecId.NONE  # raw and unencrypted: the payload is the row
        if direct:
            payload = dest
            payload[:in_head] = view[hlen:]
        elif in_head == header.stored_len:  # all here already: decode from ``head``, no copy
            payload = view[hlen:]
        else:
            payload = (scratch(header.stored_len)[: header.stored_len] if scratch is not None
                       else memoryview(bytearray(header.stored_len)))
            payload[:in_head] = view[hlen:]
        return FrameReceiver(self, header, dest, payload, len(head), payload[in_head:], direct)

    def decode_payload_into(
        self, header: FrameHeader, payload: bytes | memoryview, dest: memoryview
    ) -> None:
        """Decode a checked header's payload into ``dest`` and verify its checksum.

        With a cipher configured only encrypted frames are accepted (and vice
        versa); authentication failure is ObjectCorrupt.
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


class FrameReceiver:
    """A frame whose checked header has arrived and whose payload is on its way.

    Made by :meth:`FrameCodec.receive`. The backend reads the object's bytes
    from ``offset`` to its end into ``remaining`` (exactly that many bytes),
    then calls :meth:`finish`. ``direct`` says ``remaining`` is a view of the
    row itself (a raw payload: no copy, no decode).
    """

    __slots__ = ("_codec", "dest", "direct", "header", "offset", "payload", "remaining")

    def __init__(self, codec: FrameCodec, header: FrameHeader, dest: memoryview,
                 payload: memoryview, offset: int, remaining: memoryview, direct: bool) -> None:
        self._codec = codec
        #: The parsed, checked header.
        self.header = header
        #: The row the frame decodes into.
        self.dest = dest
        #: The whole payload's buffer (``dest`` when ``direct``).
        self.payload = payload
        #: Object offset of the first byte ``remaining`` takes.
        self.offset = offset
        #: Where the rest of the object goes: its length is what is left to read.
        self.remaining = remaining
        #: True when the payload lands in ``dest`` as is (raw, unencrypted).
        self.direct = direct

    def finish(self, dest_checksum: int | None = None) -> int | None:
        """Verify (raw) or decode (compressed, encrypted) the received payload
        into the row; returns the row's CRC-32C (:attr:`FrameHeader.row_checksum`).
        Raises :class:`ObjectCorrupt` on any mismatch (``dest`` is then unusable).

        ``dest_checksum``: ``dest``'s CRC-32C as it now is, computed by the
        reader in the GIL-free call that filled it (raw payloads only)."""
        if self.direct:
            self._codec.verify(self.header, self.dest, dest_checksum)
        else:
            self._codec.decode_payload_into(self.header, self.payload, self.dest)
        return self.header.row_checksum

    def raw_payload_at(self, offset: int) -> bool:
        """True when the row is the object's bytes from ``offset`` on as they are
        (a raw payload right after a header of ``offset`` bytes): a reader that
        put those bytes into ``dest`` has nothing left to read."""
        return self.direct and self.header.header_len == offset


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
