"""Schemathesis against /openapi.json on a real cluster: whatever it sends, no 5xx, and every error
in its API's one shape (OpenAI's; Anthropic's on /v1/messages). Bounded: a few examples per
operation, generation kept short."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from frontend.openapi import ROUTES
from tests.integration.harness import Cluster

MAX_EXAMPLES = 12
ERROR_FIELDS = {"message", "type", "param", "code"}
ANTHROPIC_ERROR_FIELDS = {"type", "message"}


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("aggregated")


def keep_it_short(body: object) -> None:
    """Valid bodies generate for real: cap what would take minutes on a CPU."""
    if isinstance(body, dict):
        caps = (("max_tokens", 8), ("max_completion_tokens", 8), ("max_output_tokens", 8), ("n", 2),
                ("best_of", 2))  # fmt: skip
        for key, cap in caps:
            if isinstance(body.get(key), int) and body[key] > cap:
                body[key] = cap
        body.pop("min_tokens", None)
        body.pop("ignore_eos", None)


def test_no_5xx_and_one_error_shape(cluster: Cluster) -> None:
    schema = schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(ROUTES)

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            keep_it_short(case.body)
            response = case.call(timeout=60)
            where = (case.method, case.path, case.body)
            assert response.status_code < 500, (where, response.text[:300])
            if response.status_code < 400:
                return
            body = response.json()
            if case.path.startswith("/v1/messages"):
                assert body["type"] == "error", (where, response.text[:300])
                assert set(body["error"]) == ANTHROPIC_ERROR_FIELDS, (where, response.text[:300])
            else:
                assert set(body["error"]) == ERROR_FIELDS, (where, response.text[:300])

        check()
