"""`pdserve status`'s path without Ray (deploy/status_endpoint.py): the controller's loopback endpoint, found
through its file, answers only its token; a dead deployment's file is removed; two live ones need `--address`."""

from __future__ import annotations

import asyncio
import http.client
import json
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy import status_endpoint
from deploy.status_endpoint import StatusEndpoint, endpoint_file, fetch_status

REPO = Path(__file__).resolve().parents[2]


class Endpoints:
    """StatusEndpoints served on an event loop of their own (the controller's, in the real thing)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.opened: list[StatusEndpoint] = []

    def open(self, ray_address: str, report: dict) -> StatusEndpoint:
        async def answer() -> dict:
            return report

        endpoint = StatusEndpoint(answer, ray_address)
        asyncio.run_coroutine_threadsafe(endpoint.start(), self.loop).result(10)
        self.opened.append(endpoint)
        return endpoint

    def close_one(self, endpoint: StatusEndpoint) -> None:
        """Closed on its loop's thread, as the controller does: asyncio's Server is not thread-safe (closing it
        from another thread while a connection ends on the loop wakes its waiters twice)."""

        async def close() -> None:
            endpoint.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)

    def close(self) -> None:
        for endpoint in self.opened:
            self.loop.call_soon_threadsafe(endpoint.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def endpoints(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    served = Endpoints()
    yield served
    served.close()


def test_the_cli_reads_the_report_through_the_file(endpoints):
    endpoint = endpoints.open("127.0.0.1:6379", {"router": {"health": "healthy"}})
    path = endpoint_file("127.0.0.1:6379")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the token is readable by its user only"
    assert fetch_status("127.0.0.1:6379") == {"router": {"health": "healthy"}}
    assert fetch_status(None) == fetch_status("auto") == {"router": {"health": "healthy"}}
    assert fetch_status("10.0.0.9:6379") is None, "another cluster's address: through Ray"
    endpoints.close_one(endpoint)
    assert not path.exists()


def test_a_wrong_token_or_path_is_refused(endpoints):
    endpoint = endpoints.open("127.0.0.1:6379", {"secret": "report"})
    port = json.loads(endpoint_file("127.0.0.1:6379").read_text())["port"]
    for target, headers, code in (("/status", {"Authorization": "Bearer guessed"}, 401), ("/status", {}, 401),
                                  ("/other", {"Authorization": f"Bearer {endpoint.token}"}, 404)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", target, headers=headers)
        response = conn.getresponse()
        assert response.status == code and b"report" not in response.read()
        conn.close()


def test_a_dead_deployments_file_is_removed_and_two_live_ones_need_an_address(endpoints):
    endpoints.open("127.0.0.1:1111", {"cluster": 1})
    endpoints.open("127.0.0.1:2222", {"cluster": 2})
    assert fetch_status(None) is None, "two deployments answer here: Ray's own choice (address=auto) decides"
    assert fetch_status("127.0.0.1:2222") == {"cluster": 2}
    dead = endpoint_file("127.0.0.1:3333")
    dead.write_text(json.dumps({"ray_address": "127.0.0.1:3333", "port": 9, "token": "t"}))  # nothing listens on port 9
    assert fetch_status("127.0.0.1:3333") is None and not dead.exists()
    assert status_endpoint.run_dir().is_dir()


STATUS_WITHOUT_RAY = """
import asyncio, json, os, sys, tempfile, threading
os.environ["PDSERVE_CACHE"] = tempfile.mkdtemp()
from deploy.status_endpoint import StatusEndpoint

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
async def report():
    return {"router": {"health": "healthy"}, "pools": {}}
endpoint = StatusEndpoint(report, "127.0.0.1:6379")
asyncio.run_coroutine_threadsafe(endpoint.start(), loop).result(10)
from deploy import cli
code = cli.main(["status", "--json"])
loop.call_soon_threadsafe(endpoint.close)
heavy = sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)
print(code, ",".join(heavy) or "-", file=sys.stderr)
"""


def test_pdserve_status_loads_neither_ray_nor_torch():
    """`pdserve status` against a controller's endpoint, in a fresh process: the report, and no Ray, torch or transformers."""
    result = subprocess.run([sys.executable, "-c", STATUS_WITHOUT_RAY], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"router": {"health": "healthy"}, "pools": {}}
    code, heavy = result.stderr.split()[-2:]
    assert code == "0" and heavy == "-", result.stderr
