"""POST /v1/responses in-process: what it cannot serve is a 400 in the official error shape
that says why, before anything reaches the cluster."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests.integration import openai_spec

MODEL = "builtin:tiny"


# each test's requests are refused before anything is submitted
pytestmark = pytest.mark.usefixtures("nothing_reaches_the_cluster")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "text only"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"background": True}, "background"),
        ({"bogus": 1}, "bogus"),
    ],
)  # fmt: skip
def test_what_it_cannot_serve_is_a_400_that_says_why(http: TestClient, fields, says) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"], response.text
    openai_spec.check("ErrorResponse", response.json())
