"""`pdserve status` without Ray: the controller answers it over a loopback HTTP endpoint.

Joining the Ray cluster as a driver (import ray, ray.init, the controller's handle) was most of the
5.5 s `pdserve status` took. Lifecycle: the controller, once its deployment started, opens a
`StatusEndpoint` on 127.0.0.1 (port from the OS) and writes where it is, with a random token, to a
file only its user can read, named by the Ray cluster's address: `<cache>/run/<address>.json`
(cache: common.model_files.cache_root). `fetch_status` (the CLI, on the same machine) reads that file
(the one for `--address`, else the one deployment it finds answering), GETs /status with the token
and returns the controller's report; without a file or an answer it returns None and the CLI goes
through Ray as before (another machine, an older controller). The controller removes its file when
it shuts down; a file whose port refuses connections (a killed deployment) is removed by the reader.
"""

from __future__ import annotations

import asyncio
import hmac
import http.client
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from common.model_files import cache_root

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 8192


def run_dir() -> Path:
    return cache_root() / "run"


def endpoint_file(ray_address: str) -> Path:
    return run_dir() / (ray_address.replace("/", "_").replace(":", "_") + ".json")


class StatusEndpoint:
    """The controller's side: GET /status (Bearer token) answers `report()` as JSON."""

    def __init__(self, report: Callable[[], Awaitable[dict]], ray_address: str):
        self.report, self.ray_address = report, ray_address
        self.token = secrets.token_urlsafe(32)
        self.server: asyncio.Server | None = None
        self.path = endpoint_file(ray_address)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        port = self.server.sockets[0].getsockname()[1]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"ray_address": self.ray_address, "port": port, "token": self.token, "pid": os.getpid()}, f)
        staging.replace(self.path)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            code, body = await self._answer(head[:MAX_REQUEST_BYTES].decode("latin-1"))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            code, body = 400, {"error": "bad request"}
        except Exception as exc:  # noqa: BLE001 - the report failed: say so rather than hang up
            log.exception("status report failed")
            code, body = 500, {"error": repr(exc)}
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {code} {'OK' if code == 200 else 'Error'}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        try:
            await writer.drain()
        finally:
            writer.close()

    async def _answer(self, head: str) -> tuple[int, dict]:
        lines = head.split("\r\n")
        if lines[0].split(" ")[:2] != ["GET", "/status"]:
            return 404, {"error": "only GET /status"}
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if not hmac.compare_digest(headers.get("authorization", ""), f"Bearer {self.token}"):
            return 401, {"error": "bad token"}
        return 200, await self.report()


def fetch_status(ray_address: str | None, timeout_s: float = 30.0) -> dict | None:
    """The report of the deployment at `ray_address` (None or "auto": the one answering here), or None."""
    if ray_address not in (None, "auto"):
        candidates = [endpoint_file(ray_address)]
    else:
        candidates = sorted(run_dir().glob("*.json")) if run_dir().is_dir() else []
    answers = [report for path in candidates if (report := _ask(path, timeout_s)) is not None]
    return answers[0] if len(answers) == 1 else None


def _ask(path: Path, timeout_s: float) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    conn = http.client.HTTPConnection(HOST, info["port"], timeout=timeout_s)
    try:
        conn.request("GET", "/status", headers={"Authorization": f"Bearer {info['token']}"})
        response = conn.getresponse()
        body = response.read()
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # nobody listens: the deployment is gone
        return None
    except OSError:
        return None
    finally:
        conn.close()
    return json.loads(body) if response.status == 200 else None
