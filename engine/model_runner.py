"""Turns a scheduled batch into tensors, runs the model, and returns logits for the sampling rows.

Decode tokens (one new token for a sequence) go first and use the decode kernel; prefill chunks
follow, packed back to back, and use the prefill/extend kernel. Only rows that end a sequence's
known tokens are projected to logits, and those of its speculative proposals (a speculating
sequence's chunk is its last token and its proposals: it runs as an extend chunk).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionBackend
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager
from engine.models.cpu_decode import decode_tokens_in_c
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
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs  # decode-only steps as CUDA graphs (engine/cuda_graphs.py)
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.backend = backend
        self.device = device
        # LongRoPE picks its table by each sequence's length (layers.RotaryEmbedding)
        self.needs_rope_lens = any(r.long_offset for r in model.rotaries)

    def run(
        self, out: SchedulerOutput
    ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor, list[PromptRows]]:
        """Forward the batch; returns the sequences that sample, their (rows, vocab) logits (1 +
        len(seq.draft_token_ids) rows each, in order: a proposal's row verifies the next) and
        (rows, hidden) final hidden states (what an embedding request pools), and the hidden
        states of every prompt position of chunks whose sequence wants prompt log-probs (the
        logits are made from them a slice at a time)."""
        decodes = [c for c in out.chunks if c.num_new_tokens == 1]
        prefills = [c for c in out.chunks if c.num_new_tokens > 1]
        chunks = decodes + prefills
        block_tables = [self.kv_manager.block_table(c.seq.seq_id) for c in chunks]
        batch = self._flatten(chunks, block_tables)
        decoded = self._decode_only(decodes, prefills, block_tables, batch)
        if decoded is None:
            decoded = self._forward(chunks, prefills, block_tables, batch), None
        hidden, every_logits = decoded  # the logits of every row, where the step made them
        ends = [e - 1 for e in itertools.accumulate(c.num_new_tokens for c in chunks)]
        rows = [i for i, c in enumerate(chunks) if c.samples]
        # each sampling chunk's last known token's row and its proposals' rows after it
        row_index = [
            r
            for i in rows
            for r in range(ends[i] - len(chunks[i].seq.draft_token_ids), ends[i] + 1)
        ]
        # (num_sampling_rows, hidden)
        if row_index == list(range(len(hidden))):  # one row a chunk, each samples: all of them
            last_hidden, index = hidden, None
        else:
            index = self._to(torch.tensor(row_index, dtype=torch.long))
            last_hidden = hidden[index]
        if every_logits is None:
            logits = self.model.logits(last_hidden)  # (num_sampling, vocab)
        else:
            logits = self.model.soft_capped(every_logits if index is None else every_logits[index])
        prompt_rows = [
            PromptRows(c.seq, c.seq.num_computed_tokens,
                       hidden[int(end) - c.num_new_tokens + 1 : int(end) + 1])  # (num_new, hidden)
            for c, end in zip(chunks, ends, strict=True)
            if c.seq.wants_prompt_logprobs
        ]  # fmt: skip
        return [chunks[i].seq for i in rows], logits, last_hidden, prompt_rows

    def _forward(
        self,
        chunks: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        block_tables: list[list[int]],
        batch: FlatBatch,
    ) -> torch.Tensor:
        """The step's forward, launched op by op: (num_tokens, hidden)."""
        if self.model.lora_batch is not None:  # each token's adapter (engine/lora/manager.py)
            self.model.lora_batch.set([c.seq for c in chunks], batch.seq_index, self.device)
        tables = _padded(block_tables)  # (num_chunks, max_blocks) int32
        total_lens = torch.tensor(
            [c.seq.num_computed_tokens + c.num_new_tokens for c in chunks], dtype=torch.int32
        )
        rope_lens = None
        if self.needs_rope_lens:  # a chunked prompt's early chunks as its whole length
            lens = [max(c.seq.num_computed_tokens + c.num_new_tokens, c.seq.num_prompt_tokens)
                    for c in chunks]  # fmt: skip
            rope_lens = torch.tensor([lens[i] for i in batch.seq_index])  # (num_tokens,)
        q_lens = torch.tensor([c.num_new_tokens for c in prefills], dtype=torch.int32)
        cu_seqlens = torch.zeros(len(prefills) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=cu_seqlens[1:])
        nd = len(chunks) - len(prefills)  # the decodes come first
        meta = AttentionMetadata(
            slot_mapping=self._to(torch.tensor(batch.slots, dtype=torch.long)),
            num_decode_tokens=nd,
            decode_block_tables=self._to(tables[:nd]),
            decode_context_lens=self._to(total_lens[:nd]),
            prefill_block_tables=self._to(tables[nd:]),
            prefill_cu_seqlens_q=self._to(cu_seqlens),
            prefill_context_lens=self._to(total_lens[nd:]),
            backend=self.backend,
            rope_seq_lens=None if rope_lens is None else self._to(rope_lens),
        )
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long)
        positions = torch.tensor(batch.positions, dtype=torch.long)
        embeds = None
        if batch.image_rows:  # placeholder tokens take their images' rows
            index = torch.tensor(batch.image_index, dtype=torch.long)
            embeds = (self._to(index), torch.cat(batch.image_rows))
        return self.model(
            self._to(input_ids), self._to(positions), self.kv_cache.layers, meta, embeds
        )  # (num_tokens, hidden)

    def _decode_only(
        self,
        decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        block_tables: list[list[int]],
        batch: FlatBatch,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A decode-only step through a path made for it, from the batch's plain lists: its CUDA
        graph (GPU) or the C step in one call (CPU): (num_decodes, hidden) hidden states, and
        (num_decodes, vocab) logits where the C step made them too. None where the step runs op
        by op (prefill chunks, proposals, images, adapters, LongRoPE, or neither path takes
        it)."""
        if (
            prefills
            or batch.image_rows  # a 1-token prompt chunk at an image
            or any(c.seq.draft_token_ids for c in decodes)
        ):
            return None
        lens = [c.seq.num_computed_tokens + 1 for c in decodes]
        graphs = self.graphs
        if graphs is None:
            if self.device != "cpu" or self.model.c_decode_max_rows == 0:
                return None
            return decode_tokens_in_c(
                self.model, batch.token_ids, batch.positions, batch.slots,
                _padded(block_tables), lens, self.kv_cache.layers,
            )  # fmt: skip
        if (
            self.model.lora_batch is not None
            or self.needs_rope_lens
            or not graphs.fits(len(decodes), block_tables)
        ):
            return None
        hidden = graphs.run(batch.token_ids, batch.positions, batch.slots, block_tables, lens)
        return None if hidden is None else (hidden, None)

    def _flatten(self, chunks: list[ScheduledChunk], tables: list[list[int]]) -> FlatBatch:
        """The chunks' new tokens back to back, as plain lists: one torch.tensor call per field
        afterwards, where tensor arithmetic cost a dozen small ops a step."""
        batch = FlatBatch([], [], [], [])
        block_size = self.kv_cache.block_size
        for i, (c, table) in enumerate(zip(chunks, tables, strict=True)):
            start = c.seq.num_computed_tokens
            span = range(start, start + c.num_new_tokens)
            for first, rows in c.seq.images:  # the part of each image this chunk runs
                lo, hi = max(first, span.start), min(first + len(rows), span.stop)
                if lo < hi:
                    offset = len(batch.token_ids) - start  # batch row of prompt index p: p + it
                    batch.image_index.extend(range(lo + offset, hi + offset))
                    batch.image_rows.append(rows[lo - first : hi - first])
            batch.token_ids.extend(c.seq.token_ids[start : span.stop])
            batch.token_ids.extend(c.seq.draft_token_ids)  # after the last known token, if any
            batch.positions.extend(span)
            batch.slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            batch.seq_index.extend([i] * c.num_new_tokens)
        return batch

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)


@dataclass(slots=True)
class FlatBatch:
    """A step's new tokens, chunk after chunk: id, position, KV slot and chunk index of each."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_index: list[int]
    image_index: list[int] = field(default_factory=list)  # batch rows that take image rows ...
    image_rows: list[torch.Tensor] = field(default_factory=list)  # ... these, in that order


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one (num_chunks, max_blocks) int32 tensor, rows padded with block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
