"""Images through a real cluster (builtin:tiny-llava) in both modes, from outside with the
official openai (chat and Responses) and anthropic SDKs: one and two images (a data: URL and an
http URL from a loopback server), greedy tokens equal to one engine in process given the same
prompt ids and the same pixels; the images cross the hand-off as the prompt's KV (the generation
worker never gets pixels); an image that fails to load is a 400 and nothing is held after."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest
import torch

from common.config import ClusterConfig
from common.sampling_params import SamplingParams
from engine.llm import LLM
from frontend.images import preprocess
from frontend.model_info import load_model_info
from tests.integration.harness import Cluster
from tests.unit.frontend.test_images import png

pytestmark = pytest.mark.long

LLAVA = "builtin:tiny-llava"
MAX_NEW = 10
FIRST, SECOND = png(90, 70, seed=1), png(64, 100, seed=2)


class OneImage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = SECOND if self.path == "/second.png" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneImage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def in_process() -> Callable[[list[int], list[bytes]], list[int]]:
    """Greedy tokens of one engine given prompt ids and encoded images."""
    llm = LLM(LLAVA, num_blocks=256, block_size=16)
    vision = load_model_info(ClusterConfig(model=LLAVA)).vision
    assert vision is not None

    def run(prompt: list[int], images: list[bytes]) -> list[int]:
        pixels = [torch.from_numpy(preprocess(data, vision)) for data in images]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        llm.engine.add_request("reference", prompt, greedy, images=pixels)
        tokens: list[int] = []
        while llm.engine.has_unfinished():
            tokens += [out.token_id for out in llm.engine.step()]
        return tokens

    return run


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_images_through_the_sdks_equal_the_engine_in_process(
    mode: str, start_cluster: Callable[..., Cluster], image_server: str, in_process
) -> None:
    cluster = start_cluster(mode, model=LLAVA)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=60, max_retries=0)
    extra = {"return_token_ids": True, "ignore_eos": True}
    parts = {
        "one": [{"type": "image_url", "image_url": {"url": data_url(FIRST)}}],
        "two": [{"type": "image_url", "image_url": {"url": data_url(FIRST)}},
                {"type": "image_url", "image_url": {"url": f"{image_server}/second.png"}}],
    }  # fmt: skip
    answers = {}
    for name, images in parts.items():
        content = [*images, {"type": "text", "text": "What is in the picture?"}]
        reply = client.chat.completions.create(
            model=LLAVA, messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW,
            temperature=0, extra_body=extra,
        )  # fmt: skip
        prompt = list(reply.prompt_token_ids)  # type: ignore[attr-defined]
        tokens = list(reply.choices[0].token_ids)  # type: ignore[attr-defined]
        assert tokens == in_process(prompt, [FIRST, SECOND][: len(images)]), name
        answers[name] = reply.choices[0].message.content
    assert answers["one"] != answers["two"]  # the second image reaches the model

    first_only = [{"type": "image_url", "image_url": {"url": data_url(FIRST)}},
                  {"type": "text", "text": "What is in the picture?"}]  # fmt: skip
    plain = client.chat.completions.create(
        model=LLAVA, messages=[{"role": "user", "content": first_only}], max_tokens=MAX_NEW,
        temperature=0,
    )  # fmt: skip
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="-", max_retries=0)
    message = claude.messages.create(
        model=LLAVA, max_tokens=MAX_NEW, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(FIRST).decode()}},
            {"type": "text", "text": "What is in the picture?"}]}],
    )  # fmt: skip
    assert message.content[0].text == plain.choices[0].message.content  # type: ignore[union-attr]
    response = client.responses.create(
        model=LLAVA, max_output_tokens=MAX_NEW, temperature=0, store=False,
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(FIRST), "detail": "auto"},
            {"type": "input_text", "text": "What is in the picture?"}]}],
    )  # fmt: skip
    assert response.output_text == plain.choices[0].message.content

    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        client.chat.completions.create(
            model=LLAVA, max_tokens=MAX_NEW,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"{image_server}/gone.png"}}]}],
        )  # fmt: skip
    info = cluster.wait_idle()
    busy = [w for w in info.workers if w.blocks_used or w.blocks_leased or w.active_requests]
    assert not busy, busy
    if mode == "disaggregated":  # the prompts were prefilled on the context worker
        assert sum(w.kv_bytes_pulled for w in info.workers if w.role == "generation") > 0
