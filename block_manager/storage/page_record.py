"""The framing of a page stored in the storage tier: header + payload + checksum.

A store is shared between processes, restarts and machines, and backends have served garbage
before (LMCache #4991, SGLang #27504) or another configuration's KV under a key that left out
the dtype or TP rank (SGLang #33268, #10969). So a value says what it is -- the fingerprint of
everything that makes KV bytes differ, the block-space name, the page's shape -- and carries a
SHA-256 of all of it; a reader that finds anything other than what it asked for treats the
value as a miss. The key already includes the fingerprint; the header is the second line of
defence, against a key collision, a foreign writer or a corrupted / truncated value.

Layout (little-endian):
    magic            4 bytes  b"HKVP"
    format version   u16
    fingerprint len  u16, space len u16, ndim u8
    fingerprint      utf-8, space utf-8
    shape            ndim x u64
    payload length   u64
    payload
    checksum         32 bytes, SHA-256 of everything before it

SHA-256 because OpenSSL's is hardware-accelerated on current x86 and ARM (well under 1 ms per
MB); the trailer position lets encode and decode hash and slice without copying the payload
more than once.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"HKVP"
FORMAT_VERSION = 1
CHECKSUM_BYTES = 32

_FIXED = struct.Struct("<4sHHHB")  # magic, version, fingerprint len, space len, ndim
_U64 = struct.Struct("<Q")
_MAX_TEXT_BYTES = 0xFFFF
_MAX_NDIM = 0xFF

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class DecodeResult:
    """The payload when the record is the one asked for, else None and why (for counters and
    logs: a checksum mismatch is corruption, a foreign fingerprint is a configuration clash)."""

    payload: bytes | None
    reason: str  # "ok" or one of the REJECT_* reasons below

    @property
    def ok(self) -> bool:
        return self.payload is not None


REJECT_TRUNCATED = "truncated"
REJECT_BAD_MAGIC = "bad_magic"
REJECT_BAD_VERSION = "bad_version"
REJECT_FOREIGN_FINGERPRINT = "foreign_fingerprint"
REJECT_FOREIGN_SPACE = "foreign_space"
REJECT_SHAPE_MISMATCH = "shape_mismatch"
REJECT_LENGTH_MISMATCH = "length_mismatch"
REJECT_CHECKSUM_MISMATCH = "checksum_mismatch"


def encode(fingerprint: str, space: str, shape: tuple[int, ...], payload: Buffer) -> bytes:
    """The stored value for one page's bytes of one block space."""
    fp = fingerprint.encode("utf-8")
    sp = space.encode("utf-8")
    if len(fp) > _MAX_TEXT_BYTES or len(sp) > _MAX_TEXT_BYTES:
        raise ValueError("fingerprint and space name must each encode to at most 65535 bytes")
    if len(shape) > _MAX_NDIM or any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be at most 255 non-negative ints, got {shape!r}")
    body = memoryview(payload).cast("B")
    header = b"".join(
        [
            _FIXED.pack(MAGIC, FORMAT_VERSION, len(fp), len(sp), len(shape)),
            fp,
            sp,
            struct.pack(f"<{len(shape)}Q", *shape),
            _U64.pack(body.nbytes),
        ]
    )
    digest = hashlib.sha256(header)
    digest.update(body)
    return b"".join([header, body, digest.digest()])


def decode_checked(
    blob: Buffer | None, fingerprint: str, space: str, shape: tuple[int, ...] | None = None
) -> DecodeResult:
    """The payload of `blob` if it is a whole, uncorrupted record of this fingerprint and space
    (and of this shape, when given); otherwise payload None and the first reason it is not."""
    if blob is None:
        return DecodeResult(None, REJECT_TRUNCATED)
    view = memoryview(blob).cast("B")
    total = view.nbytes
    if total < _FIXED.size:
        return DecodeResult(None, REJECT_TRUNCATED)
    magic, version, fp_len, sp_len, ndim = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        return DecodeResult(None, REJECT_BAD_MAGIC)
    if version != FORMAT_VERSION:
        return DecodeResult(None, REJECT_BAD_VERSION)
    header_len = _FIXED.size + fp_len + sp_len + 8 * ndim + _U64.size
    if total < header_len + CHECKSUM_BYTES:
        return DecodeResult(None, REJECT_TRUNCATED)
    offset = _FIXED.size
    stored_fp = view[offset : offset + fp_len]
    offset += fp_len
    stored_space = view[offset : offset + sp_len]
    offset += sp_len
    stored_shape = struct.unpack_from(f"<{ndim}Q", view, offset)
    offset += 8 * ndim
    (payload_len,) = _U64.unpack_from(view, offset)
    room = total - header_len - CHECKSUM_BYTES
    if payload_len != room:
        return DecodeResult(None, REJECT_TRUNCATED if payload_len > room else REJECT_LENGTH_MISMATCH)
    # The checksum before the identity fields, so a corrupted header reads as corruption and a
    # foreign fingerprint / space / shape means an intact record of another configuration.
    if hashlib.sha256(view[: total - CHECKSUM_BYTES]).digest() != view[total - CHECKSUM_BYTES :]:
        return DecodeResult(None, REJECT_CHECKSUM_MISMATCH)
    if stored_fp != fingerprint.encode("utf-8"):
        return DecodeResult(None, REJECT_FOREIGN_FINGERPRINT)
    if stored_space != space.encode("utf-8"):
        return DecodeResult(None, REJECT_FOREIGN_SPACE)
    if shape is not None and tuple(shape) != stored_shape:
        return DecodeResult(None, REJECT_SHAPE_MISMATCH)
    return DecodeResult(bytes(view[header_len : total - CHECKSUM_BYTES]), "ok")


def decode(blob: Buffer | None, fingerprint: str, space: str, shape: tuple[int, ...] | None = None) -> bytes | None:
    """The payload, or None when the value is truncated, corrupted or not this page's kind."""
    return decode_checked(blob, fingerprint, space, shape).payload
