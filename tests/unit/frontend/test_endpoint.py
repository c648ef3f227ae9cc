"""What every endpoint shares (frontend/endpoint.py), in-process: a body that is not JSON, has
the wrong shape, is too big, nests too deeply or holds values that cannot cross the wire is a
4xx in the one error shape, and nothing reaches the cluster or stays open."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from common.tokenizer import Tokenizer

MODEL = "builtin:tiny"


# each test's requests are refused before anything is submitted
pytestmark = pytest.mark.usefixtures("nothing_reaches_the_cluster")


def test_bad_bodies_are_4xx_in_the_one_shape(http: TestClient) -> None:
    cases = [
        (b"\xff\xfe not utf-8", 400),
        (b'{"model": "builtin:tiny", "prompt": 5}', 400),
        (b'{"model": "builtin:tiny", "prompt": "x", "n": 1000000}', 400),
        (b'{"model": "builtin:tiny", "prompt": "x", "logprobs": 99}', 400),
        (b"[]", 400),
        (b'{"model": "builtin:tiny", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}', 413),
    ]
    for body, status in cases:
        response = http.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == status, (body[:60], response.text[:200])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    wrong_method = http.get("/v1/completions")  # the client's mistake, typed as one
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_strange_values_are_400s_that_leave_nothing_open(http: TestClient) -> None:
    """The integrity issue's seventh case: each of these was a 500, and the integers beyond 64
    bits also left an entry in the frontend's open-request table for good."""
    huge = 2**70
    b64_negative = "/////wEAAAA="  # int32 -1, then 1
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    completions = "/v1/completions"
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (completions, {"prompt": "x", "seed": huge}),
        (completions, {"prompt": "x", "top_k": huge}),
        (completions, {"prompt": "x", "priority": huge}),
        (completions, {"prompt": [1, huge]}),
        (completions, {"prompt": [1, -3]}),
        (completions, {"prompt_token_ids_b64": b64_negative}),
        (completions, {"prompt": "x", "guided_json": "{not json"}),
        (completions, {"prompt": ["x"] * 4096}),  # one request must not take every slot
        (chat, {"messages": user, "seed": -huge}),
        (chat, {"messages": user, "guided_json": "[1, 2"}),
    ]
    for url, fields in cases:
        response = http.post(url, json={"model": MODEL, **fields})
        assert response.status_code == 400, (fields, response.text[:300])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], fields
    nested = f'{{"model": "{MODEL}", "prompt": "x", "guided_json": {deep}}}'.encode()
    response = http.post(completions, content=nested, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nests too deeply" in response.text
    # (nothing_reaches_the_cluster: the frontend's open-request table stays empty)


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five megabytes under the body cap: a 400 at once (tokenizing them would take seconds)."""
    tokenized: list[str] = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: tokenized.append(text) or [])
    text = "many words in a very long prompt " * 150_000
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
    assert tokenized == []
