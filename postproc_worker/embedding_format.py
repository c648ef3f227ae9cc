"""POST /v1/embeddings' body for one input: the vector the engine pooled, as floats or as the
base64 of its little-endian float32 bytes (what the `openai` SDK asks for by default)."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np

from common.openai_schema import Embedding, EmbeddingList, EmbeddingUsage
from postproc_worker.openai_frames import json_encoder

if TYPE_CHECKING:
    from postproc_worker.formatter import ChoiceState, RequestState


class EmbeddingRenderer:
    def __init__(self, state: RequestState) -> None:
        self.state = state

    def stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        raise ValueError("embeddings are not streamed")

    def end_frames(self) -> bytes:
        raise ValueError("embeddings are not streamed")

    def body(self) -> bytes:
        state = self.state
        if state.embedding is None:
            raise ValueError("the engine sent no embedding")
        if state.embedding_base64:
            vector: list[float] | str = base64.b64encode(state.embedding).decode("ascii")
        else:
            vector = np.frombuffer(state.embedding, dtype="<f4").tolist()
        return json_encoder.encode(
            EmbeddingList(
                data=[Embedding(index=state.index_offset, embedding=vector)],
                model=state.model,
                usage=EmbeddingUsage(
                    prompt_tokens=state.num_prompt_tokens, total_tokens=state.num_prompt_tokens
                ),
            )
        )
