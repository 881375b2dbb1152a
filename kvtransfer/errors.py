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
    """Base class: a transfer failed and its KV must not be used."""

    code: ErrorCode = ErrorCode.PROTOCOL

    def __init__(self, message: str, transfer_id: str | None = None):
        super().__init__(message)
        self.transfer_id = transfer_id

    def __str__(self) -> str:
        text = super().__str__()
        return f"[{self.transfer_id}] {text}" if self.transfer_id else text


class FingerprintMismatch(KVTransferError):
    """Sender and receiver run different models, dtypes or KV layouts."""

    code = ErrorCode.FINGERPRINT_MISMATCH


class ShapeMismatch(KVTransferError):
    """Header, layer index or payload size disagrees with what the receiver expects."""

    code = ErrorCode.SHAPE_MISMATCH


class ChecksumMismatch(KVTransferError):
    """Payload bytes differ from what the sender checksummed (corruption in flight)."""

    code = ErrorCode.CHECKSUM_MISMATCH


class TransferTimeout(KVTransferError):
    """A wait (expect, connect, ack) ran past its deadline."""

    code = ErrorCode.TIMEOUT


class UnknownTransfer(KVTransferError):
    """The receiver was not expecting this transfer id (never, or no longer)."""

    code = ErrorCode.UNKNOWN_TRANSFER


class TransferAborted(KVTransferError):
    """The peer disconnected mid-transfer, or a side aborted or cancelled it."""

    code = ErrorCode.ABORTED


class ProtocolError(KVTransferError):
    """Malformed frame or a frame out of order; the connection is dropped."""

    code = ErrorCode.PROTOCOL


class AuthenticationFailed(KVTransferError):
    """The sender's header does not prove the cluster's shared secret; nothing was written."""

    code = ErrorCode.UNAUTHENTICATED


_BY_CODE: dict[ErrorCode, type[KVTransferError]] = {
    cls.code: cls
    for cls in (
        FingerprintMismatch,
        ShapeMismatch,
        ChecksumMismatch,
        TransferTimeout,
        UnknownTransfer,
        TransferAborted,
        ProtocolError,
        AuthenticationFailed,
    )
}


def error_from_code(code: int, message: str, transfer_id: str | None = None) -> KVTransferError:
    """Rebuild the typed exception a peer reported as `code`."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        cls = ProtocolError
        message = f"unknown error code {code}: {message}"
    return cls(message, transfer_id)
