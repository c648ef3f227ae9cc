"""Multi-LoRA at the frontend: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
routes and bodies), `model: <adapter name>` on the generation routes (or the seed's
`lora_request` on completions and chat), and the adapters' cards
in GET /v1/models (vLLM's shape: `parent` is the base model).

The orchestrator holds the cluster's adapter table (cluster.yaml's, then each round's outcome:
orchestrator/lora_round.py); a frontend keeps a copy, refreshed from ClusterInfo when a request
names a model it does not know, so an adapter loaded through another frontend is found.
Like every route but /health, the two POSTs need the API key when one is set.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from common.errors import InvalidRequest
from common.protocol import GenerateRequest, LoRACommand
from frontend.endpoint import FrontendState, NotFound, decode_body, state_of
from frontend.generation import error_response
from frontend.seed_extensions import LoRARequest

ANSWER_TIMEOUT_S = 130.0  # past the orchestrator's round deadline (lora_round.py)
REFRESH_TIMEOUT_S = 1.0


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (here: unload first)


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, unread: adapters are named here


async def lora_of(state: FrontendState, name: str | None) -> str | None:
    """The adapter a request's `model` names (None: the base model); 404 for a model that is
    neither, after asking the orchestrator for adapters loaded elsewhere."""
    if name is None or name == state.model.name:
        return None
    if name not in state.lora_adapters and state.config.lora is not None:
        info = await state.client.cluster_info(REFRESH_TIMEOUT_S)
        if info is not None:
            state.lora_adapters = dict(info.lora_adapters)
    if name not in state.lora_adapters:
        raise NotFound(f"the model {name!r} does not exist", "model", "model_not_found")
    return name


async def lora_for(
    state: FrontendState, model: str | None, request: LoRARequest | None
) -> str | None:
    """The adapter a completions or chat request runs with: `model`'s, or the seed's
    `lora_request` naming a loaded adapter (its path, when given, must be the one loaded: an
    adapter is loaded by POST /v1/load_lora_adapter, never by a generation request)."""
    by_model = await lora_of(state, model)
    if request is None:
        return by_model
    if state.config.lora is None:
        raise InvalidRequest(
            "lora_request: LoRA is off (set `lora` in cluster.yaml)", "lora_request"
        )
    name = request.lora_name
    if by_model is not None and by_model != name:
        raise InvalidRequest(
            f"model names the adapter {by_model!r} and lora_request {name!r}", "lora_request"
        )
    if name not in state.lora_adapters:
        await refresh_adapters(state)
    path = state.lora_adapters.get(name)
    if path is None:
        raise InvalidRequest(
            f"lora_request names {name!r}, which is not loaded: load it first with "
            "POST /v1/load_lora_adapter",
            "lora_request",
        )
    if request.lora_path is not None and request.lora_path != path:
        raise InvalidRequest(
            f"lora_request.lora_path {request.lora_path!r} is not where {name!r} was loaded "
            f"from ({path!r}); adapters are loaded by POST /v1/load_lora_adapter",
            "lora_request",
        )
    return name


def with_lora(generates: list[GenerateRequest], lora_name: str | None) -> list[GenerateRequest]:
    if lora_name is None:
        return generates
    return [msgspec.structs.replace(g, lora_name=lora_name) for g in generates]


def adapter_cards(state: FrontendState) -> list[dict[str, object]]:
    model = state.model
    return [
        {"id": name, "object": "model", "created": model.created, "owned_by": "pdcluster",
         "root": path, "parent": model.name, "max_model_len": model.max_model_len}
        for name, path in sorted(state.lora_adapters.items())
    ]  # fmt: skip


async def refresh_adapters(state: FrontendState) -> None:
    if state.config.lora is not None:
        info = await state.client.cluster_info(REFRESH_TIMEOUT_S)
        if info is not None:
            state.lora_adapters = dict(info.lora_adapters)


async def load_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, LoadLoRAAdapterRequest)
    _check_enabled(state, body.lora_name)
    await refresh_adapters(state)
    if body.lora_name in state.lora_adapters:
        if not body.load_inplace:
            raise InvalidRequest(
                f"the LoRA adapter {body.lora_name!r} has already been loaded", "lora_name"
            )
        unloaded = await _command(state, LoRACommand(action="unload", lora_name=body.lora_name))
        if unloaded.status_code != 200:
            return unloaded
    command = LoRACommand(action="load", lora_name=body.lora_name, lora_path=body.lora_path)
    return await _command(state, command)


async def unload_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, UnloadLoRAAdapterRequest)
    _check_enabled(state, body.lora_name)
    await refresh_adapters(state)
    if body.lora_name not in state.lora_adapters:
        raise NotFound(f"the LoRA adapter {body.lora_name!r} cannot be found", "lora_name",
                       "lora_not_found")  # fmt: skip
    return await _command(state, LoRACommand(action="unload", lora_name=body.lora_name))


def _check_enabled(state: FrontendState, name: str) -> None:
    if state.config.lora is None:
        raise InvalidRequest("LoRA is off: set `lora` in cluster.yaml", "lora_name")
    if not name or name == state.model.name:
        raise InvalidRequest(f"{name!r} cannot name a LoRA adapter", "lora_name")


async def _command(state: FrontendState, command: LoRACommand) -> Response:
    """200 (vLLM's plain-text answer) when every engine worker did it; else the workers' reasons:
    400 when none did, 500 when some did and some did not (the table says where it stands)."""
    done = await state.client.lora(command, ANSWER_TIMEOUT_S)
    if done is None:
        return error_response(503, "the orchestrator does not answer", code="unhealthy")
    await refresh_adapters(state)
    if done.errors:
        status = 500 if done.workers else 400
        return error_response(status, "; ".join(done.errors), code="lora_adapter_error")
    verb = "added" if command.action == "load" else "removed"
    return PlainTextResponse(f"Success: LoRA adapter '{command.lora_name}' {verb} successfully.")
