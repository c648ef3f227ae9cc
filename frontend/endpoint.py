"""What every endpoint shares: the app's state (one typed record on `app.state`, set by
`build_app`), the body decoded against its schema, the model check, and work moved off the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from common.config import ClusterConfig
from common.errors import InvalidRequest, validation_location
from common.protocol import GenerateRequest, encode
from frontend.batch_store import BatchStore
from frontend.cluster_client import ClusterClient
from frontend.message_batches import BatchRunner
from frontend.model_info import ModelInfo
from frontend.response_store import ResponseStore

T = TypeVar("T")


@dataclass(slots=True)
class FrontendState:
    """What the endpoints read: one record, so that each handler's needs are typed."""

    config: ClusterConfig
    client: ClusterClient
    model: ModelInfo
    response_store: ResponseStore
    batch_store: BatchStore
    batches: BatchRunner
    # the LoRA adapters served, name -> path: the orchestrator's table as last read (lora.py)
    lora_adapters: dict[str, str] = field(default_factory=dict)


def state_of(request: Request) -> FrontendState:
    state: FrontendState = request.app.state.frontend
    return state


class NotFound(InvalidRequest):
    """A 404 in the one error shape: what the request names (a model, a stored response, a
    batch) does not exist."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message, param)
        self.code = code


async def decode_body(request: Request, schema: type[T]) -> T:
    """The body as `schema`: 413 over `frontend.max_body_bytes`, else a 400 naming the field."""
    max_body = state_of(request).config.frontend.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise HTTPException(413, f"the request body is over {max_body} bytes")
    body = await request.body()
    if len(body) > max_body:
        raise HTTPException(413, f"the request body is over {max_body} bytes")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        raise InvalidRequest(str(e), param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("the body nests too deeply") from None


def param_of(message: str) -> str | None:
    """The request field a msgspec message points at (or the unknown field it names)."""
    _, path = validation_location(message)
    if path is not None:
        return path.split("[")[0]
    if message.startswith("Object contains unknown field `"):
        return message.split("`")[1]
    return None


def check_model(model: ModelInfo, name: str | None) -> None:
    if name is not None and name != model.name:
        raise NotFound(f"the model {name!r} does not exist", "model", "model_not_found")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Tokenizing and template rendering run in a thread: the loop only orchestrates."""
    return await asyncio.to_thread(fn, *args)


async def translate(fn: Callable[..., list[GenerateRequest]], *args: Any) -> list[GenerateRequest]:
    """A request body to the cluster's messages, off the loop. Translation reads nothing but
    the client's data, so whatever it trips over there is the client's 400, never a 500;
    the messages are encoded once here so that what cannot cross the wire (an integer
    beyond 64 bits) is found before the cluster or the open-request table sees it."""
    try:
        generates = await off_loop(fn, *args)
        for generate in generates:
            encode(generate)
    except InvalidRequest:
        raise
    except (ValueError, OverflowError, RecursionError) as e:
        raise InvalidRequest(f"the request cannot be served: {e}") from None
    return generates


def json_response(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
