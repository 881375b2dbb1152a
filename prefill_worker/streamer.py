"""The engine's `KVLayerSink` on a prefill worker's ranks: every layer of a prompt in flight goes
onto its `PieceSend` (this rank's heads, to the decode ranks that own them) the moment the forward
wrote it, so layer i travels while layer i+1 computes (layer-wise streaming)."""

from __future__ import annotations

import torch

from kvtransfer.faults import FaultPoint, reached
from kvtransfer.pieces import PieceSend


class LayerStreamer:
    """The engine's `KVLayerSink` on a prefill worker: the transfers in flight, by request id. Build it
    first and give it to the `Engine` and to `PrefillService`; every layer the engine hands over for
    one of them goes onto that transfer at once (engine thread; `send_layer` never blocks)."""

    def __init__(self, fault_point: FaultPoint | None = None):
        self._transfers: dict[str, PieceSend] = {}
        self._fault_point = fault_point

    def track(self, request_id: str, transfer: PieceSend) -> None:
        self._transfers[request_id] = transfer

    def forget(self, request_id: str) -> None:
        self._transfers.pop(request_id, None)

    def wanted_from(self, request_id: str) -> int | None:
        transfer = self._transfers.get(request_id)
        return None if transfer is None else transfer.start

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        transfer = self._transfers.get(request_id)
        if transfer is not None:
            transfer.send_layer(layer, k, v)
            reached(self._fault_point, "prefill.after_layer", request_id, layer)
