"""Images on the frontend, in process: preprocessing equal to transformers' CLIP image processor;
an image in a chat, Anthropic or Responses request becomes the model's placeholder run in the
prompt and its pixels and digest on the request (builtin:tiny-llava); what cannot be loaded, a
text model, or too many images is a 400 naming the image, and nothing reaches the cluster."""

from __future__ import annotations

import base64
import hashlib
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from common.config import ClusterConfig, FrontendConfig
from common.protocol import decode_token_ids
from engine.builtin_build import ensure_builtin
from frontend import images
from frontend.app import build_app
from frontend.model_info import load_model_info
from tests.unit.frontend.test_generation import whole_body

LLAVA = "builtin:tiny-llava"


def png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava_dir() -> Path:
    return ensure_builtin(LLAVA)


@pytest.fixture(scope="module")
def vision(llava_dir: Path) -> images.VisionInfo:
    info = load_model_info(ClusterConfig(model=LLAVA)).vision
    assert info is not None
    return info


@pytest.mark.parametrize(("width", "height"), [(56, 56), (120, 80), (33, 97), (640, 480)])
def test_preprocessing_equals_clips_image_processor(llava_dir, vision, width, height) -> None:
    from transformers import CLIPImageProcessor

    data = png(width, height, seed=width)
    from PIL import Image

    expected = CLIPImageProcessor.from_pretrained(llava_dir)(
        Image.open(io.BytesIO(data)), return_tensors="np"
    )["pixel_values"][0]
    got = images.preprocess(data, vision)
    assert got.shape == expected.shape == (3, 56, 56)
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.fixture
def llava_http(fake, tmp_path) -> Iterator[TestClient]:
    config = ClusterConfig(
        model=LLAVA, frontend=FrontendConfig(responses_store=str(tmp_path / "store.sqlite3"))
    )
    fake.reply = whole_body
    with TestClient(build_app(config, fake, load_model_info(config))) as http:
        yield http


class Images(BaseHTTPRequestHandler):
    """/ok.png an image; /missing a 404; /slow never answers in time; /huge too many bytes."""

    body = png(80, 60, seed=7)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._send(200, self.body)
        elif self.path == "/huge":
            self._send(200, b"\0" * (images.MAX_IMAGE_BYTES + 1))
        elif self.path == "/slow":
            threading.Event().wait(3)
            self._send(200, self.body)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def chat_body(*parts: dict) -> dict:
    content = [*parts, {"type": "text", "text": "what?"}]
    return {"model": LLAVA, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_carries(request, vision, expected: list[bytes]) -> None:
    """The submitted request: each image's placeholder run, pixels and digest, in order."""
    prompt = decode_token_ids(request.prompt_token_ids_b64)
    assert prompt.count(vision.image_token_id) == len(expected) * vision.num_image_tokens
    wanted = [images.preprocess(data, vision).tobytes() for data in expected]
    assert [image.pixels for image in request.images] == wanted
    assert [image.digest for image in request.images] == [
        hashlib.sha256(w).hexdigest() for w in wanted
    ]
    assert [k for k in request.extra_keys if k[0] == "image"] == [
        ("image", image.digest) for image in request.images
    ]


def test_a_chat_with_a_data_url_and_an_http_image(llava_http, fake, vision, image_server) -> None:
    first = png(90, 70, seed=1)
    body = chat_body(image_part(data_url(first)), image_part(f"{image_server}/ok.png"))
    response = llava_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (request,) = fake.submitted
    assert_carries(request, vision, [first, Images.body])


def test_anthropic_and_responses_images_take_the_same_path(llava_http, fake, vision) -> None:
    data = png(64, 64, seed=2)
    anthropic = {"model": LLAVA, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(data).decode()}},
        {"type": "text", "text": "what?"}]}]}  # fmt: skip
    assert llava_http.post("/v1/messages", json=anthropic).status_code == 200
    responses = {"model": LLAVA, "max_output_tokens": 4, "store": False, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(data)},
                                     {"type": "input_text", "text": "what?"}]}]}  # fmt: skip
    assert llava_http.post("/v1/responses", json=responses).status_code == 200, "responses"
    first, second = fake.submitted
    assert_carries(first, vision, [data])
    assert_carries(second, vision, [data])
    assert first.prompt_token_ids_b64 == second.prompt_token_ids_b64


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (data_url(png(1, 1000)), "the long side at most 64 times"),
        (data_url(png(80, 1)), "the long side at most 64 times"),
        ("data:image/png;base64,@@@", "not valid base64"),
        (data_url(b"not an image at all"), "could not be decoded"),
        ("ftp://example.com/x.png", "must be http(s):// or data:"),
        ("{server}/missing", "HTTP 404"),
        ("{server}/huge", "over"),
        ("{server}/slow", "took over"),
    ],
)
def test_an_image_that_cannot_be_loaded_is_a_400_naming_it(
    llava_http, fake, image_server, monkeypatch, url: str, message: str
) -> None:
    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 1.0)
    body = chat_body(image_part(data_url(png(60, 60))), image_part(url.format(server=image_server)))
    response = llava_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "messages[0].content[1].image_url"
    assert fake.submitted == [] and fake.open == {}


def test_images_a_model_or_request_cannot_take_are_refused(http, llava_http, fake) -> None:
    """A text model; more images than allowed; an image token typed in the text."""
    image = image_part(data_url(png(60, 60)))
    text_only = http.post(
        "/v1/chat/completions", json={**chat_body(image), "model": "builtin:tiny"}
    )
    assert text_only.status_code == 400 and "text only" in text_only.json()["error"]["message"]
    many = llava_http.post(
        "/v1/chat/completions", json=chat_body(*[image] * (images.MAX_IMAGES + 1))
    )
    assert many.status_code == 400 and "at most" in many.json()["error"]["message"]
    spelled = chat_body(image, {"type": "text", "text": "<|image_pad|>"})
    typed = llava_http.post("/v1/chat/completions", json=spelled)
    assert typed.status_code == 400 and "image tokens" in typed.json()["error"]["message"]
    assert fake.submitted == []


def test_precomputed_embeddings_are_refused_and_never_beside_an_image(llava_http, fake) -> None:
    """The seed's rule: media and precomputed embeddings are exclusive; embeddings alone are
    not accepted either (the model's own encoder reads the image)."""
    embeds = {"type": "image_embeds", "image_embeds": "AAAA"}
    both = llava_http.post("/v1/chat/completions",
                           json=chat_body(image_part(data_url(png(60, 60))), embeds))  # fmt: skip
    assert both.status_code == 400
    assert "mutually exclusive" in both.json()["error"]["message"]
    assert both.json()["error"]["param"] == "messages[0].content[1].image_embeds"
    alone = llava_http.post("/v1/chat/completions", json=chat_body(embeds))
    assert alone.status_code == 400 and "not accepted" in alone.json()["error"]["message"]
    assert fake.submitted == []


def test_an_image_declaring_too_many_pixels_is_refused_before_it_is_decoded(vision) -> None:
    """A PNG header that declares 7,000 x 7,000 pixels: refused from the header alone."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (7_000, 7_000)).save(out, format="PNG")  # a few kB compressed
    assert len(out.getvalue()) < 100_000
    with pytest.raises(ValueError, match="at most 40,000,000 an image"):
        images.preprocess(out.getvalue(), vision)
