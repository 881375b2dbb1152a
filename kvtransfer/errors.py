"""Typed failures of a KV transfer, shared by senders, receivers and the wire.

Lifecycle: a receiver detects a problem (bad header, bad layer, bad checksum, deadline, peer
gone, cancel), fails the transfer's future with one of these exceptions, and tells the sender
the same `ErrorCode` in a RESULT frame; the sender raises the matching exception from its ack.
Workers map `ErrorCode` names onto `pdserve.v1.ErrorCode` (`ERROR_CODE_KV_<NAME>`).
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Outcome of a transfer as carried in RESULT frames. OK is success."""

    OK = 0
    FINGERPRINT_MISMATCH = 1
    SHAPE_MISMATCH = 2
    CHECKSUM_MISMATCH = 3
    TIMEOUT = 4
    UNKNOWN_TRANSFER = 5
    ABORTED = 6
    PROTOCOL = 7
    UNAUTHENTICATED = 8


class KVTransferError(Exception):
    """Base class: a transfer failed and its KV must not be used. A subclass names its code
    (`class X(KVTransferError, code=ErrorCode.X)`), which makes it the one `error_from_code` rebuilds."""

    code: ErrorCode = ErrorCode.PROTOCOL
    _by_code: dict[ErrorCode, type[KVTransferError]] = {}

    def __init_subclass__(cls, code: ErrorCode, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = code
        KVTransferError._by_code[code] = cls

    def __init__(self, message: str, transfer_id: str | None = None):
        super().__init__(message)
        self.transfer_id = transfer_id

    def __str__(self) -> str:
        text = super().__str__()
        return f"[{self.transfer_id}] {text}" if self.transfer_id else text


class FingerprintMismatch(KVTransferError, code=ErrorCode.FINGERPRINT_MISMATCH):
    """Sender and receiver run different models, dtypes or KV layouts."""


class ShapeMismatch(KVTransferError, code=ErrorCode.SHAPE_MISMATCH):
    """Header, layer index or payload size disagrees with what the receiver expects."""


class ChecksumMismatch(KVTransferError, code=ErrorCode.CHECKSUM_MISMATCH):
    """Payload bytes differ from what the sender checksummed (corruption in flight)."""


class TransferTimeout(KVTransferError, code=ErrorCode.TIMEOUT):
    """A wait (expect, connect, ack) ran past its deadline."""


class UnknownTransfer(KVTransferError, code=ErrorCode.UNKNOWN_TRANSFER):
    """The receiver was not expecting this transfer id (never, or no longer)."""


class TransferAborted(KVTransferError, code=ErrorCode.ABORTED):
    """The peer disconnected mid-transfer, or a side aborted or cancelled it."""


class ProtocolError(KVTransferError, code=ErrorCode.PROTOCOL):
    """Malformed frame or a frame out of order; the connection is dropped."""


class AuthenticationFailed(KVTransferError, code=ErrorCode.UNAUTHENTICATED):
    """The sender's header does not prove the cluster's shared secret; nothing was written."""


def error_from_code(code: int, message: str, transfer_id: str | None = None) -> KVTransferError:
    """Rebuild the typed exception a peer reported as `code`."""
    try:
        cls = KVTransferError._by_code[ErrorCode(code)]
    except (ValueError, KeyError):
        cls = ProtocolError
        message = f"unknown error code {code}: {message}"
    return cls(message, transfer_id)
