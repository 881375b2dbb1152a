"""KV cache transfer between prefill and decode workers.

Decode worker (receiver side)::

    receiver = KVReceiver(kv_cache, transport="ucx", host="127.0.0.1")
    endpoint = await receiver.start()                      # KVEndpoint(host, port, transport)
    fut = receiver.expect(transfer_id, block_ids, num_tokens, fingerprint(layout, cfg), timeout=30)
    received = await fut                                   # ReceivedKV(first_token=..., ...)
    receiver.cancel(transfer_id)                           # client gone; fut fails TransferAborted
    await receiver.close()

Prefill worker (sender side; the engine thread may call send_layer directly)::

    sender = KVSender()                                    # owns an I/O thread and its loop
    xfer = sender.begin(endpoint, TransferHeader.for_layout(transfer_id, layout, n, fp))
    xfer.send_layer(layer, k, v)                           # per layer, right after its forward
    ack = await xfer.finish(first_token_id) and xfer.wait(timeout)   # TransferAck
    sender.close()

Failures raise `KVTransferError` subclasses (`FingerprintMismatch`, `ShapeMismatch`,
`ChecksumMismatch`, `TransferTimeout`, `UnknownTransfer`, `TransferAborted`) on both sides.
"""

from kvtransfer.errors import (
    ChecksumMismatch,
    ErrorCode,
    FingerprintMismatch,
    KVTransferError,
    ProtocolError,
    ShapeMismatch,
    TransferAborted,
    TransferTimeout,
    UnknownTransfer,
)
from kvtransfer.faults import FaultInjector
from kvtransfer.messages import KVEndpoint, ReceivedKV, TransferAck
from kvtransfer.receiver import KVReceiver, ReceiverStats
from kvtransfer.sender import KVSender, OutgoingTransfer, SenderStats
from kvtransfer.transport.base import Channel, Listener, Transport, get_transport
from kvtransfer.wire import TransferHeader, fingerprint

__all__ = [
    "Channel",
    "ChecksumMismatch",
    "ErrorCode",
    "FaultInjector",
    "FingerprintMismatch",
    "KVEndpoint",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "Listener",
    "OutgoingTransfer",
    "ProtocolError",
    "ReceivedKV",
    "ReceiverStats",
    "SenderStats",
    "ShapeMismatch",
    "TransferAborted",
    "TransferAck",
    "TransferHeader",
    "TransferTimeout",
    "Transport",
    "UnknownTransfer",
    "fingerprint",
    "get_transport",
]
