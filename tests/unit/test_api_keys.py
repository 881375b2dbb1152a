"""API keys on the public API: HTTP 401 (OpenAI shape) and gRPC UNAUTHENTICATED without a valid key."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from fastapi.testclient import TestClient

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.grpc_api import RouterApi
from router.http_app import build_app
from router.service import RouterService
from tests.unit.test_openai_schema import GOOD, SETTINGS, FakeService

KEYED = dataclasses.replace(SETTINGS, api_keys=frozenset({"sk-good"}))
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


def keyed_client() -> TestClient:
    service = FakeService(GOOD)
    service.settings = KEYED
    return TestClient(build_app(service))


@pytest.mark.parametrize("header", [None, "Bearer sk-bad", "sk-good", "Basic sk-good"])
def test_http_refuses_missing_or_wrong_key(header):
    headers = {"Authorization": header} if header else {}
    response = keyed_client().post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert "authorization" in response.json()["error"]["message"]


def test_http_accepts_valid_key_and_leaves_health_open():
    client = keyed_client()
    assert client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-good"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_no_keys_configured_means_open():
    assert SETTINGS.authorized(None) and not KEYED.authorized(None) and KEYED.authorized("Bearer sk-good")


class _Context:
    def __init__(self, metadata):
        self._metadata = metadata
        self.aborted = None

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


async def test_grpc_generate_refuses_without_key():
    service = RouterApi(RouterService(KEYED, tokenizer=None, pool=None, metrics=None))
    context = _Context([("authorization", "Bearer nope")])
    with pytest.raises(grpc.aio.AbortError):
        async for _ in service.Generate(pb.GenerateRequest(text="hi"), context):
            pass
    assert context.aborted[0] == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in context.aborted[1]
