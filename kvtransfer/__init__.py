"""KV cache transfer between prefill and decode workers.

Decode worker (receiver side), on its event loop::

    receiver = KVReceiver(kv_cache, transport="ucx", host="127.0.0.1")     # port 0: OS picks
    endpoint = await receiver.start()           # KVEndpoint(host, port, transport): advertise it
    fut = receiver.expect(transfer_id, block_ids, num_tokens, fingerprint(layout, cfg_json), timeout=30)
    received = await fut                        # ReceivedKV(first_token=..., first_logprob=..., transfer_s=...)
    receiver.cancel(transfer_id)                # e.g. client gone: fut fails with TransferAborted
    await receiver.close()

The future resolves only when the receiver no longer writes into `block_ids`; free or reuse the
blocks after it resolves, whatever the outcome.

Prefill worker (sender side); `send_layer` is thread-safe and never blocks, so the engine
thread calls it right after each layer's forward::

    sender = KVSender()                         # owns an I/O thread with its event loop
                                                # (both sides: secret=... to sign/check headers)
    xfer = sender.begin(endpoint, TransferHeader.for_layout(transfer_id, layout, n, fp))
    xfer.send_layer(layer, k, v)                # [n, kv_heads, head_dim] each, per layer
    xfer.finish(first_token_id, logprob, top)   # logprobs optional; returns a concurrent.futures.Future too
    ack = await xfer.wait(timeout=30)           # TransferAck, from any event loop
    sender.close()

Failures raise `KVTransferError` subclasses (`FingerprintMismatch`, `ShapeMismatch`,
`ChecksumMismatch`, `TransferTimeout`, `UnknownTransfer`, `TransferAborted`,
`AuthenticationFailed`) on both sides;
`error.code` is an `ErrorCode` whose name maps onto proto `ERROR_CODE_KV_<NAME>`.
"""

from kvtransfer.errors import (
    AuthenticationFailed,
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
from kvtransfer.messages import KVEndpoint, ReceivedKV, ReceiverStats, SenderStats, TransferAck
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender, OutgoingTransfer
from kvtransfer.transport.base import Channel, Listener, Transport, get_transport
from kvtransfer.wire import TransferHeader, fingerprint

__all__ = [
    "AuthenticationFailed",
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
