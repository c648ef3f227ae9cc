"""The vendored extract of the official OpenAPI description is what the extractor makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.extract_openai_schemas import HERE, extract

DESCRIPTION = Path(__file__).resolve().parents[3] / "shared/reference/openai-openapi.json"


def test_extract_is_up_to_date() -> None:
    if not DESCRIPTION.is_file():
        pytest.skip(f"the full description is not beside this checkout ({DESCRIPTION})")
    fresh = extract(json.loads(DESCRIPTION.read_text()))
    assert json.loads((HERE / "openai-schemas.json").read_text()) == fresh
