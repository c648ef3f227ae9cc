"""Offline API: `LLM(model).generate(prompts, params)`, used by tests, benchmarks and scripts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from common.builtin_models import TINY
from common.hub_models import parse_hub_id, prepare_snapshot
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, TokenOutput


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: (log-prob, top alternatives) of prompt tokens 1, 2, ...
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class LLM:
    def __init__(self, model: str = TINY.name, **engine_options: Any) -> None:
        hub = parse_hub_id(model)
        if hub is not None:  # downloaded when the cache lacks it, as `orchestrator up` does
            prepare_snapshot(hub)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts as one continuous batch until all finish; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p)
                outputs = [CompletionOutput(index=i) for i in range(p.n)]
                results[request_id] = RequestOutput(request_id, ids, outputs)
            while self.engine.has_unfinished():
                for token in self.engine.step():
                    self._collect(results[token.request_id], token)
        finally:
            for request_id in results:
                self.engine.abort(request_id)  # a no-op for finished requests
        for result in results.values():
            for out in result.outputs:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return list(results.values())

    @staticmethod
    def _collect(result: RequestOutput, token: TokenOutput) -> None:
        out = result.outputs[token.index]
        out.token_ids.append(token.token_id)
        if token.logprob is not None:
            out.logprobs.append(token.logprob)
            out.top_logprobs.append(token.top_logprobs or [])
        out.finish_reason = token.finish_reason
        result.num_cached_tokens = token.num_cached_tokens
        if token.prompt_logprobs is not None:
            result.prompt_logprobs = token.prompt_logprobs
