"""The backends a serving run sends to, each filling a `RequestRecord` as the stream arrives:
`GrpcBackend` (pdserve's Router/Generate) and `OpenAIBackend` (streaming completions or chat over SSE)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from bench.servebench.records import RequestRecord
from bench.servebench.workload import RequestSpec


class GrpcBackend:
    """pdserve's `Router/Generate` (token ids in, token chunks out)."""

    name = "grpc"

    def __init__(self, address: str, model: str | None, args: argparse.Namespace):
        import grpc

        from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        self.args, self.model = args, model
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.RouterStub(self.channel)

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock) -> None:
        import grpc

        from proto.pdserve.v1 import pdserve_pb2 as pb

        args = self.args
        sampling = pb.SamplingParams(max_tokens=spec.output_len, temperature=args.temperature, ignore_eos=args.ignore_eos)
        if args.temperature > 0:
            sampling.seed = args.seed + spec.index
        request = pb.GenerateRequest(sampling=sampling, model=self.model or "", skip_detokenize=args.skip_detokenize, priority=spec.priority)
        if spec.prompt_ids is not None:
            request.token_ids.ids.extend(spec.prompt_ids)
        else:
            request.text, request.raw = spec.prompt_text, True
        rec.start_s, rec.sent = clock(), True
        call = self.stub.Generate(request, timeout=args.request_timeout)
        try:
            async for response in call:
                now = clock()
                if response.prompt_token_ids:
                    rec.prompt_tokens = len(response.prompt_token_ids)
                if response.chunk.token_ids:
                    rec.chunk_times_s.append(now)
                    rec.chunk_tokens.append(len(response.chunk.token_ids))
                if response.finish_reason:
                    rec.finish_reason = pb.FinishReason.Name(response.finish_reason)
                    rec.output_tokens = response.usage.completion_tokens or sum(rec.chunk_tokens)
                    rec.cached_prompt_tokens = response.usage.cached_prompt_tokens
                    t = response.timings
                    rec.server_timings = {k: getattr(t, k) for k in (
                        "router_queue_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "decode_admission_s", "ttft_s", "e2e_s")}
                    if response.finish_reason == pb.FINISH_REASON_ERROR:
                        rec.error = f"{pb.ErrorCode.Name(response.error.code)}: {response.error.message}"
            rec.end_s = clock()
            rec.ok = rec.error is None and rec.finish_reason is not None
            if rec.finish_reason is None:
                rec.error = "stream ended without a finish reason"
        except grpc.aio.AioRpcError as exc:
            rec.end_s = clock()
            rec.error = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def close(self) -> None:
        await self.channel.close()


class OpenAIBackend:
    """Any OpenAI-compatible server: streaming `/completions` or `/chat/completions` over SSE."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None, args: argparse.Namespace):
        self.base_url, self.model, self.args = base_url.rstrip("/"), model, args
        self.session = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.args.request_timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        if not self.model:
            async with self.session.get(f"{self.base_url}/models") as resp:
                resp.raise_for_status()
                self.model = (await resp.json())["data"][0]["id"]

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock) -> None:
        import aiohttp

        args = self.args
        prompt: Any = spec.prompt_text if spec.prompt_text is not None else spec.prompt_ids
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": spec.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        if spec.priority:
            body["priority"] = spec.priority
        if args.temperature > 0:
            body["seed"] = args.seed + spec.index
        body.update(getattr(args, "extra_body", None) or {})  # e.g. pdserve's {"critical_path": true}
        if args.endpoint == "chat":
            url = f"{self.base_url}/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else " ".join(map(str, prompt))}]
        else:
            url = f"{self.base_url}/completions"
            body["prompt"] = prompt
        rec.start_s, rec.sent = clock(), True
        try:
            async with self.session.post(url, json=body) as resp:
                if resp.status != 200:
                    rec.end_s = clock()
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                done = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    now = clock()
                    self._absorb(json.loads(data), rec, now)
                rec.end_s = clock()
                if rec.error is None and not done:
                    rec.error = "stream ended without [DONE]"
        except (TimeoutError, aiohttp.ClientError) as exc:
            rec.end_s = clock()
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        if rec.output_tokens == 0:
            rec.output_tokens = sum(rec.chunk_tokens)
        rec.ok = rec.error is None

    def _absorb(self, event: dict, rec: RequestRecord, now: float) -> None:
        if "error" in event:
            rec.error = str(event["error"].get("message", event["error"]))
            return
        usage = event.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens") or 0
        if event.get("critical_path"):
            rec.server_timings = event["critical_path"]
        for choice in event.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                logprobs = choice.get("logprobs") or {}
                rec.chunk_times_s.append(now)
                rec.chunk_tokens.append(len(logprobs.get("tokens") or logprobs.get("content") or [0]))
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
