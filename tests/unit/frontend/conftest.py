"""The frontend in-process: the real app (routes, validation, translation, merging) over a fake
cluster client that answers from canned events, driven by starlette's TestClient (an httpx
client, so the official SDKs can use it as theirs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from starlette.testclient import TestClient

from common.config import ClusterConfig, FrontendConfig
from common.protocol import ClusterInfo, GenerateRequest, KVEventsDrained, ProfileDone, encode
from frontend.app import build_app
from frontend.cluster_client import Event
from frontend.model_info import ModelInfo, load_model_info

MODEL = "builtin:tiny"


class FakeClusterClient:
    """The methods the endpoints use from frontend.cluster_client.ClusterClient. `reply` gives
    each submitted request's events (what the postproc workers or the orchestrator would send);
    `submitted`, `aborted` and `open` show what reached the cluster and what is still held."""

    reply_to = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.reply: Callable[[GenerateRequest], list[Event]] = lambda request: []
        self.info: ClusterInfo | None = None
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.open: dict[str, asyncio.Queue[Event]] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submit(self, request: GenerateRequest) -> asyncio.Queue[Event]:
        encode(request)  # as ClusterClient.submit does first: what cannot be sent is not held
        self.submitted.append(request)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        for event in self.reply(request):
            queue.put_nowait(event)
        self.open[request.request_id] = queue
        return queue

    def abort(self, request_id: str) -> None:
        if self.open.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def done(self, request_id: str) -> None:
        self.open.pop(request_id, None)

    async def cluster_info(self, timeout_s: float) -> ClusterInfo | None:
        return self.info

    async def drain_kv_events(self, timeout_s: float) -> KVEventsDrained | None:
        return None

    async def profile(
        self, action: Literal["start", "stop"], timeout_s: float
    ) -> ProfileDone | None:
        return None


@pytest.fixture(scope="session")
def model(tiny_model_path: Path) -> ModelInfo:
    return load_model_info(ClusterConfig(model=MODEL))


@pytest.fixture
def fake() -> FakeClusterClient:
    return FakeClusterClient()


@pytest.fixture
def make_http(
    model: ModelInfo, fake: FakeClusterClient, tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    """make_http(**frontend_keys) -> a TestClient on the app over `fake` (lifespan run)."""
    opened: list[TestClient] = []

    def make(**frontend: object) -> TestClient:
        store = str(tmp_path / f"store-{len(opened)}.sqlite3")
        config = ClusterConfig(
            model=MODEL, frontend=FrontendConfig(responses_store=store, **frontend)
        )
        http = TestClient(build_app(config, fake, model), raise_server_exceptions=False)
        opened.append(http.__enter__())
        return http

    yield make
    for http in opened:
        http.__exit__(None, None, None)


@pytest.fixture
def nothing_reaches_the_cluster(fake: FakeClusterClient) -> Iterator[None]:
    """After the test: no request was submitted, none is open."""
    yield
    assert fake.submitted == [] and fake.open == {}


@pytest.fixture
def http(make_http: Callable[..., TestClient]) -> TestClient:
    return make_http()


@pytest.fixture
def oai(http: TestClient) -> openai.OpenAI:
    """The official SDK over the in-process app."""
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )
