"""Turns a scheduled batch into tensors, runs the model, and returns logits for the sampling rows.

Decode tokens (one new token for a sequence) go first and use the decode kernel; prefill chunks
follow, packed back to back, and use the prefill/extend kernel. Only rows that end a sequence's
known tokens are projected to logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager
from engine.models.decoder import CausalLM
from engine.models.layers import AttentionMetadata
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence


@dataclass(slots=True)
class PromptRows:
    """The hidden states of a chunk's positions `start`, `start + 1`, ... of one sequence: row
    i predicts the token at position start + i + 1."""

    seq: Sequence
    start: int
    hidden: torch.Tensor  # (num_new_tokens, hidden)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        kv_manager: KVCacheManager,
        backend: AttentionBackend,
        device: str,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.backend = backend
        self.device = device
        # LongRoPE picks its table by each sequence's length (layers.RotaryEmbedding)
        self.needs_rope_lens = any(r.long_offset for r in model.rotaries)

    def run(
        self, out: SchedulerOutput
    ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor, list[PromptRows]]:
        """Forward the batch; returns the sequences that sample, their (rows, vocab) logits and
        (rows, hidden) final hidden states (what an embedding request pools), and the hidden
        states of every prompt position of chunks whose sequence wants prompt log-probs (the
        logits are made from them a slice at a time)."""
        decodes = [c for c in out.chunks if c.num_new_tokens == 1]
        prefills = [c for c in out.chunks if c.num_new_tokens > 1]
        chunks = decodes + prefills
        input_ids, positions, seq_index = self._flatten(chunks)
        tables = self._block_tables(chunks)  # (num_chunks, max_blocks) int32
        block_size = self.kv_cache.block_size
        slot_mapping = tables[seq_index, positions // block_size].long() * block_size + (
            positions % block_size
        )  # (num_tokens,)
        total_lens = torch.tensor(
            [c.seq.num_computed_tokens + c.num_new_tokens for c in chunks], dtype=torch.int32
        )
        rope_lens = None
        if self.needs_rope_lens:  # a chunked prompt's early chunks as its whole length
            rope_lens = torch.tensor([
                max(c.seq.num_computed_tokens + c.num_new_tokens, c.seq.num_prompt_tokens)
                for c in chunks
            ])  # fmt: skip
        q_lens = torch.tensor([c.num_new_tokens for c in prefills], dtype=torch.int32)
        cu_seqlens = torch.zeros(len(prefills) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=cu_seqlens[1:])
        nd = len(decodes)
        meta = AttentionMetadata(
            slot_mapping=self._to(slot_mapping),
            num_decode_tokens=nd,
            decode_block_tables=self._to(tables[:nd]),
            decode_context_lens=self._to(total_lens[:nd]),
            prefill_block_tables=self._to(tables[nd:]),
            prefill_cu_seqlens_q=self._to(cu_seqlens),
            prefill_context_lens=self._to(total_lens[nd:]),
            backend=self.backend,
            rope_seq_lens=None if rope_lens is None else self._to(rope_lens[seq_index]),
        )
        hidden = self.model(
            self._to(input_ids), self._to(positions), self.kv_cache.layers, meta
        )  # (num_tokens, hidden)
        ends = torch.cumsum(torch.tensor([c.num_new_tokens for c in chunks]), 0) - 1
        rows = [i for i, c in enumerate(chunks) if c.samples]
        last_hidden = hidden[self._to(ends[rows])]  # (num_sampling, hidden)
        logits = self.model.logits(last_hidden)  # (num_sampling, vocab)
        prompt_rows = [
            PromptRows(c.seq, c.seq.num_computed_tokens,
                       hidden[int(end) - c.num_new_tokens + 1 : int(end) + 1])  # (num_new, hidden)
            for c, end in zip(chunks, ends, strict=True)
            if c.seq.wants_prompt_logprobs
        ]  # fmt: skip
        return [chunks[i].seq for i in rows], logits, last_hidden, prompt_rows

    def _flatten(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        for c in chunks:
            start = c.seq.num_computed_tokens
            ids.extend(c.seq.token_ids[start : start + c.num_new_tokens])
        lens = torch.tensor([c.num_new_tokens for c in chunks])
        starts = torch.tensor([c.seq.num_computed_tokens for c in chunks])
        seq_index = torch.repeat_interleave(torch.arange(len(chunks)), lens)  # (num_tokens,)
        offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens
        )
        positions = starts[seq_index] + offsets
        return torch.tensor(ids, dtype=torch.long), positions, seq_index

    def _block_tables(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        tables = [self.kv_manager.block_table(c.seq.seq_id) for c in chunks]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)
