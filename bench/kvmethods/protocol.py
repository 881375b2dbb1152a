"""The full kvtransfer protocol between two child processes (kvtransfer.testing.loopback): KVSender ->
KVReceiver into a KVCache, per-layer checksums, trailer, ack; one `ProtocolMethod` per
`ProtocolConfig` (transport, environment, transport options, zero copy or staging)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.kvmethods.base import Method, measure


@dataclass(frozen=True)
class ProtocolConfig:
    """One pair of child processes running the kvtransfer protocol with these settings."""

    name: str
    transports: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    transport_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    zero_copy: bool = True
    label: str = ""  # result key for the non-default variants (default: the transport name)


PROTOCOL_CONFIGS = (
    ProtocolConfig("default", ("tcp", "ucx")),
    ProtocolConfig("ucx_staging", ("ucx",), zero_copy=False, label="ucx_staging"),
    ProtocolConfig("ucx_window_2", ("ucx",), transport_options={"ucx": {"window": 2}}, label="ucx_window_2"),
    ProtocolConfig("ucx_tls_tcp", ("ucx",), env={"UCX_TLS": "tcp"}, label="ucx_tls_tcp"),
)


class ProtocolMethod(Method):
    """KVSender and KVReceiver children (kvtransfer.testing.loopback) for one ProtocolConfig."""

    def __init__(self, config: ProtocolConfig, tokens: list[int]):
        from kvtransfer.testing.loopback import Peer, PeerSpec

        self.config = config
        self.tokens = tokens
        self.keys = tuple(config.label or t for t in config.transports)
        spec = PeerSpec(
            transports=config.transports,
            num_blocks=-(-max(tokens) // 16),
            env=config.env,
            transport_options=config.transport_options,
            zero_copy=config.zero_copy,
        )
        self.receiver, self.sender = Peer("receiver", spec), Peer("sender", spec)
        self.count = 0

    def launch(self) -> None:
        self.receiver.launch()
        self.sender.launch()

    def wait_ready(self, timeout: float) -> None:
        self.receiver.ready = self.receiver.wait_reply(timeout)
        self.sender.ready = self.sender.wait_reply(timeout)
        for n in self.tokens:
            self.sender.call("prepare", n, n, timeout=120)

    def run(self, num_tokens: int, warmup: bool) -> dict[str, tuple[float, float | None]]:
        out = {}
        blocks = list(range(-(-num_tokens // 16)))
        for key, transport in zip(self.keys, self.config.transports, strict=True):
            self.count += 1
            tid = f"{key}-{num_tokens}-{self.count}"
            self.receiver.call("expect", transport, tid, blocks, num_tokens, 60.0)
            plan = {"endpoint": self.receiver.ready[transport], "tid": tid, "num_tokens": num_tokens, "seed": num_tokens, "verify": warmup}
            sent = self.sender.call("send", [plan], timeout=120)["transfers"][0]
            got = self.receiver.call("result", tid, 60.0, warmup, timeout=120)
            if not (sent["ok"] and got["ok"]):
                raise RuntimeError(f"{key} {num_tokens} tokens failed: {sent} {got}")
            if warmup and sent["kv_crc"] != got["kv_crc"]:  # the warm-up round proves the bytes arrived intact
                raise RuntimeError(f"{key} {num_tokens} tokens: received KV differs from sent KV")
            out[key] = (sent["duration_s"], got["transfer_s"])
        return out

    def stop(self) -> None:
        from kvtransfer.testing.loopback import Peer

        Peer.stop_all([self.receiver, self.sender])


def bench_protocol(config: ProtocolConfig, tokens: list[int], repeats: int) -> dict[str, Any]:
    """The kvtransfer protocol alone for one config: {transport or label: {tokens: summary}}."""
    return measure([ProtocolMethod(config, tokens)], tokens, repeats)[0]
