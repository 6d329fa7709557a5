"""page_record: a stored page is returned only when it is whole, uncorrupted, and of the
fingerprint and space asked for -- anything else is a miss (None), never wrong bytes."""
from __future__ import annotations

import os
import time

import pytest

from hybridkv.block_manager.storage import page_record

FP = "llama-3b|bf16|page16|tp0of1|sha256:abc"
SPACE = "full_attn"
SHAPE = (2, 16, 8, 64)


@pytest.fixture
def payload() -> bytes:
    return os.urandom(4096)


@pytest.fixture
def blob(payload) -> bytes:
    return page_record.encode(FP, SPACE, SHAPE, payload)


def test_round_trip_returns_the_payload(blob, payload):
    assert page_record.decode(blob, FP, SPACE) == payload, "decode(encode(x)) must return x"
    assert page_record.decode(blob, FP, SPACE, shape=SHAPE) == payload, "the stored shape must match the encoded one"
    assert page_record.decode(bytearray(blob), FP, SPACE) == payload, "decode must accept any bytes-like blob"
    assert page_record.decode(page_record.encode(FP, SPACE, (0,), b""), FP, SPACE) == b"", "an empty payload round-trips"


def test_every_flipped_byte_is_rejected(blob):
    """Header, payload or checksum: one flipped bit anywhere makes the record a miss."""
    positions = list(range(0, 80)) + list(range(80, len(blob), 97)) + list(range(len(blob) - 40, len(blob)))
    for pos in positions:
        corrupted = bytearray(blob)
        corrupted[pos] ^= 0x01
        assert page_record.decode(bytes(corrupted), FP, SPACE) is None, f"a flipped bit at byte {pos} must be a miss"
    corrupted = bytearray(blob)
    corrupted[len(blob) // 2] ^= 0xFF
    assert page_record.decode_checked(bytes(corrupted), FP, SPACE).reason == page_record.REJECT_CHECKSUM_MISMATCH, (
        "corruption in the payload is reported as a checksum mismatch"
    )


def test_truncated_and_extended_blobs_are_rejected(blob):
    for cut in (0, 1, 4, 12, 40, len(blob) // 2, len(blob) - 33, len(blob) - 1):
        assert page_record.decode(blob[:cut], FP, SPACE) is None, f"a blob truncated to {cut} bytes must be a miss"
    assert page_record.decode(blob + b"\0", FP, SPACE) is None, "trailing bytes after the checksum must be a miss"
    assert page_record.decode(None, FP, SPACE) is None, "a missing blob is a miss"


def test_foreign_fingerprint_space_shape_or_format_are_rejected(blob):
    other_fp = page_record.decode_checked(blob, FP.replace("bf16", "fp16"), SPACE)
    assert other_fp.payload is None and other_fp.reason == page_record.REJECT_FOREIGN_FINGERPRINT, (
        "a page of another configuration (fingerprint) must be a miss"
    )
    other_space = page_record.decode_checked(blob, FP, "swa_window")
    assert other_space.payload is None and other_space.reason == page_record.REJECT_FOREIGN_SPACE, (
        "a page of another block space must be a miss"
    )
    other_shape = page_record.decode_checked(blob, FP, SPACE, shape=(2, 16, 8, 128))
    assert other_shape.payload is None and other_shape.reason == page_record.REJECT_SHAPE_MISMATCH, (
        "a page of another shape must be a miss when the caller names the shape"
    )
    assert page_record.decode(b"XXXX" + blob[4:], FP, SPACE) is None, "a foreign value (bad magic) must be a miss"
    future = bytearray(blob)
    future[4] = page_record.FORMAT_VERSION + 1
    assert page_record.decode_checked(bytes(future), FP, SPACE).reason == page_record.REJECT_BAD_VERSION, (
        "a record of another format version must be a miss"
    )


def test_encode_decode_of_a_1mb_page_is_fast():
    """Generous bound: the checksum must not dominate a storage read (SHA-256 is ~1 ms/MB)."""
    payload = os.urandom(1 << 20)
    started = time.perf_counter()
    for _ in range(10):
        assert page_record.decode(page_record.encode(FP, SPACE, (1 << 20,), payload), FP, SPACE) == payload
    per_page_ms = (time.perf_counter() - started) / 10 * 1e3
    assert per_page_ms < 50, f"encode+decode of a 1 MB page took {per_page_ms:.1f} ms (must stay well under a recompute)"
