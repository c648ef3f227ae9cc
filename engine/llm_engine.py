"""The engine core: requests in, one token per running sequence out, each `step()`.

Workers drive it directly (add_request / step / abort); `engine.llm.LLM` wraps it for offline use.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import msgspec
import torch

from common.block_hash import ExtraKey
from common.config import KVOffloadConfig, context_length
from common.errors import InvalidRequest
from common.kv_events import KVEvent
from common.protocol import FinishReason
from common.sampling_params import SamplingParams
from engine.beam_search import BeamGroup
from engine.block_pool import NoFreeBlocksError
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.draft_proposer import DraftModelProposer
from engine.guided import GrammarCompiler
from engine.host_memory import keep_freed_memory
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.kv_cache_manager import KVCacheManager, KVCacheStats
from engine.kv_offload import KVOffload
from engine.linear import choose_layout, drop_decode_copies, pack_linear_layers
from engine.lora import lora_registry
from engine.lora.registry import no_lora
from engine.model_runner import ModelRunner, PromptRows
from engine.models import load_model, read_model_config
from engine.models.cpu_decode import use_c_decode_step, use_cpu_kernels
from engine.models.moe import use_expert_kernels
from engine.prompt_images import encode_images, salted
from engine.sampler import Sampler, SampleResult, SamplingState, choice_seed
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec_verify import verify
from engine.thinking_budget import ThinkingTracker
from engine.weight_arena import place_streamed_weights


@dataclass(slots=True)
class TokenOutput:
    """One new token of one sequence (a request's choice `index`), as produced by one step."""

    request_id: str
    index: int
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: FinishReason | None  # stop | length | abort, once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    # With the first token of choice 0, when asked for: each prompt token's log-prob given the
    # ones before it (from the second token on) and its top alternatives.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    embedding: bytes | None = None  # SamplingParams.embed: little-endian float32 values
    queue_s: float = 0.0  # the sequence's wait before it first ran here
    run_s: float = 0.0  # since it first ran here: its first output's is its prefill
    # A prefill-only beam search's prompt (token_id -1): the first step's best continuations,
    # (token id, log-prob), for the reader to start its beams from
    beam_candidates: list[tuple[int, float]] | None = None


@dataclass(slots=True, frozen=True)
class AdmissionCounters:
    """Since the engine started: what admission found in the prefix cache, and the queue."""

    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # ... and found there
    num_admitted: int  # first admissions ...
    queue_seconds: float  # ... and the seconds they waited for them, in all


@dataclass(slots=True)
class SpecDecodeCounters:
    """Since the engine started (vLLM's spec_decode counters): verification steps of a
    sequence with proposals, the proposed tokens, and those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_SLICE = 256  # prompt positions turned into logits at once


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = config.model_dir()
        self.model_config = read_model_config(self.model_dir)
        # past max_position_embeddings the rotary tables have no rows, nor the model training
        self.max_model_len, capped = context_length(
            self.model_config.max_position_embeddings, config.max_model_len, config.num_blocks,
            config.block_size,
        )  # fmt: skip
        if capped:
            logger.info("%s", capped)
        self.model = load_model(
            self.model_dir, self.model_config, config.torch_dtype, self.max_model_len,
            config.quantization,
        ).to(config.device)  # fmt: skip
        if config.device == "cpu":
            keep_freed_memory()  # the next step's activations reuse this one's pages
        layout = choose_layout(config.device, config.torch_dtype)
        # beside oneDNN (bfloat16), the C decode step's own copy of the weights (linear.py)
        decode_copy = layout == "onednn" and cpu_kernels.library() is not None
        pack_linear_layers(self.model, layout, decode_copy)
        self.expert_kernel = use_expert_kernels(self.model, config.device, config.attention_backend)
        norm_weight = self.model.model.norm.weight  # the model's dtype and device
        if config.attention_backend in ("auto", "cpu") and cpu_kernels.runs(norm_weight):
            use_cpu_kernels(self.model)  # "torch" keeps every op in torch, the reference path
        self.kv_cache = KVCache(
            self.model_config,
            config.num_blocks,
            config.block_size,
            config.kv_torch_dtype,
            config.device,
        )
        # decode-only steps as one C call (models/cpu_decode.py); where it cannot run, its copy goes
        if not (cpu_kernels.supports(self.kv_cache.layers[0][0]) and use_c_decode_step(self.model)):
            drop_decode_copies(self.model)
        if config.device == "cpu":
            place_streamed_weights(self.model)  # one huge-page stream in step order
        offload = (
            KVOffload(self.kv_cache.pool, config.kv_offload) if config.kv_offload.enabled else None
        )
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, offload
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.speculative,
            self._draft_proposer(),
            config.step_fill_tokens,
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.kv, config.attention_backend, config.device,
            self._decode_graphs(),
        )  # fmt: skip
        self.loras = lora_registry(self.model, config.lora)  # None: no adapters (engine/lora/)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.num_prompt_tokens_computed = 0  # prompt tokens this engine ran through the model
        self.num_generated_tokens = 0  # tokens sampled
        self.spec = SpecDecodeCounters()
        self.grammars = GrammarCompiler(
            self.model_dir, self.model_config.vocab_size, tuple(self.model_config.eos_token_ids)
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """On a GPU with cuda_graphs on: every decode bucket, captured now (cuda_graphs.py)."""
        if not self.config.cuda_graphs or torch.device(self.config.device).type != "cuda":
            return None
        graphs = DecodeGraphs(
            self.model, self.kv_cache, self.config.attention_backend, self.config.device,
            self.config.max_num_seqs, -(-self.max_model_len // self.config.block_size),
        )  # fmt: skip
        graphs.capture_all()
        return graphs

    def _draft_proposer(self) -> DraftModelProposer | None:
        """With `method: draft_model`, the draft's own engine (its weights, KV pool and runner)
        behind the proposer; None for n-gram speculation or none."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        assert spec.model is not None
        config = dataclasses.replace(
            self.config,
            model=spec.model,
            quantization=spec.quantization,
            enable_prefix_caching=False,
            kv_offload=KVOffloadConfig(),
            lora=None,
            speculative=None,
        )
        vocab_size = read_model_config(config.model_dir()).vocab_size
        if vocab_size > self.model_config.vocab_size:  # checked before its weights load
            raise ValueError(
                f"the draft model {spec.model} has {vocab_size} token ids, the target "
                f"{self.model_config.vocab_size}: a draft must share the target's tokenizer"
            )
        logger.info("speculating with the draft model %s", spec.model)
        return DraftModelProposer(LLMEngine(config))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        extra_keys: tuple[ExtraKey, ...] = (),
        *,
        prefill_only: bool = False,
        priority: int = 0,
        images: list[torch.Tensor] | None = None,
    ) -> None:
        """Queue a request (n sequences); if it can't run, raise InvalidRequest, change nothing.

        `prefill_only` (context worker): each sequence stops after its first token and keeps its
        blocks, held for a reader, until `release_held`. `priority`: higher is scheduled first.
        `images`: pixel values (channels, size, size), one per run of image placeholders in the
        prompt, for a model with an image encoder (engine/prompt_images.py).
        """
        self._validate(request_id, prompt_token_ids, params)
        images = images or []
        rows = encode_images(self.model, self.model_config.vision, prompt_token_ids, images)
        extra_keys = salted(extra_keys, images)
        for index in range(1 if params.beam else params.n):  # a beam search starts as one
            seq = self._sequence(request_id, index, prompt_token_ids, params, extra_keys)
            seq.prefill_only = prefill_only
            seq.priority = priority
            seq.images = rows
            self.scheduler.add(seq)

    def needs_images(self, prompt_token_ids: list[int]) -> bool:
        """The prompt holds image placeholders: it can be prefilled only with its images (a
        generation worker, which pulls the KV of such a prompt, cannot recompute it)."""
        vision = self.model_config.vision
        return vision is not None and vision.image_token_id in prompt_token_ids

    def add_pulled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_tokens: dict[int, int],
        num_cached_tokens: int = 0,
        extra_keys: tuple[ExtraKey, ...] = (),
        priority: int = 0,
        beam_candidates: list[tuple[int, float]] | None = None,
    ) -> tuple[list[int], int] | None:
        """Admit a request another worker prefilled: `first_tokens` maps each unfinished choice to
        the token it sampled there. The prompt's KV is to be written into the returned block table
        (by a NIXL READ) from block `num_valid // block_size` on; the head is this worker's own
        prefix-cache hits. Returns (block table, num_valid tokens), or None when the pool is short
        (try again later). Call `pull_done` once the KV is in, or `pull_failed`. A beam search
        brings `beam_candidates` (the prompt's best continuations) instead of first tokens.
        """
        seqs = self._continued(
            request_id, prompt_token_ids, params, first_tokens, num_cached_tokens, extra_keys,
            priority,
        )  # fmt: skip
        beam = seqs[0].beam
        if beam is not None and beam_candidates is not None:
            beam.offer(seqs[0], beam_candidates)
        table = self.scheduler.add_pulling(seqs, len(prompt_token_ids))
        if table is None:
            return None
        return table, seqs[0].num_computed_tokens

    def add_continued_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_tokens: dict[int, int],
        extra_keys: tuple[ExtraKey, ...] = (),
        priority: int = 0,
    ) -> None:
        """A request another worker prefilled whose KV cannot be read (its lease ended, its
        source is gone): queue it to prefill here, prompt and first token, and go on decoding
        from there; the output is what the pull would have given. Not for a prompt with images
        (`needs_images`): their pixels stayed with the context worker."""
        if self.needs_images(prompt_token_ids):
            raise InvalidRequest("a prompt with images cannot be prefilled without them", "prompt")
        for seq in self._continued(
            request_id, prompt_token_ids, params, first_tokens, 0, extra_keys, priority
        ):
            self.scheduler.add(seq)

    def _continued(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_tokens: dict[int, int],
        num_cached_tokens: int,
        extra_keys: tuple[ExtraKey, ...],
        priority: int,
    ) -> list[Sequence]:
        """The sequences of the unfinished choices, each holding its first token. The prompt's
        log-probs, if asked for, went out with that token from the worker that sampled it."""
        self._validate(request_id, prompt_token_ids, params)
        params = msgspec.structs.replace(params, prompt_logprobs=None)
        seqs = []
        if params.beam:  # one prompt sequence: its first step's offer came, or it computes it
            first_tokens = {0: -1}
        for index, token_id in sorted(first_tokens.items()):
            seq = self._sequence(request_id, index, prompt_token_ids, params, extra_keys)
            if token_id >= 0:
                seq.append_token(token_id)
            seq.num_cached_prompt_tokens = num_cached_tokens
            seq.priority = priority
            seqs.append(seq)
        return seqs

    def pull_done(self, request_id: str) -> list[TokenOutput]:
        """The pulled KV is in: the request runs. A beam search's prompt already has its offer
        (add_pulled_request): its beams start now, and with max_tokens 1 it ends now."""
        lead = self.scheduler.pulling[request_id][0]
        self.scheduler.pull_done(request_id, lead.num_prompt_tokens)
        if lead.beam is None:
            return []
        if lead.seq_id not in lead.beam.offers:  # none came with it: compute it here
            lead.num_computed_tokens -= 1
            return []
        self.scheduler.park(lead)
        return self._select(lead.beam)

    def pull_failed(self, request_id: str, recompute: bool) -> list[TokenOutput]:
        """Free the pulled request's blocks; recompute its prompt here, or end it (aborted).
        A prompt with images (`needs_images`) cannot be recomputed: InvalidRequest, nothing
        changed (its pixels stayed with the context worker; the caller ends it instead)."""
        pulling = self.scheduler.pulling.get(request_id)
        lead = pulling[0] if pulling else None
        if recompute and lead and self.needs_images(lead.token_ids[: lead.num_prompt_tokens]):
            raise InvalidRequest("a prompt with images cannot be recomputed without them", "prompt")
        seqs = self.scheduler.pull_failed(request_id, recompute)
        if recompute and seqs[0].beam is not None:
            seqs[0].beam.forget(seqs[0])  # its offer is recomputed with its prompt
        return [] if recompute else self._aborted_all(seqs)

    def held_block_table(self, request_id: str) -> list[int]:
        """The blocks of a prefill-only request's first choice: the prompt's KV, for a reader."""
        return self.kv.block_table(self.scheduler.held[request_id][0].seq_id)

    def release_held(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter on this worker; ValueError (nothing changed) when LoRA is
        off, the adapter is unreadable or does not fit, or every slot is taken."""
        if self.loras is None:
            raise ValueError("LoRA is off on this engine (cluster.yaml lora)")
        self.loras.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """ValueError when it is not loaded, or a sequence still runs with it."""
        if self.loras is None:
            raise ValueError("LoRA is off on this engine (cluster.yaml lora)")
        s = self.scheduler
        live = [*s.waiting, *s.running, *s.parked.values()]
        live += [seq for seqs in (*s.held.values(), *s.pulling.values()) for seq in seqs]
        self.loras.unload(name, live)

    @property
    def lora_adapters(self) -> list[str]:
        return [] if self.loras is None else self.loras.names

    @property
    def num_held_blocks(self) -> int:
        return len(
            {
                block
                for seqs in self.scheduler.held.values()
                for seq in seqs
                for block in self.kv.block_table(seq.seq_id)
            }
        )

    def _sequence(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        extra_keys: tuple[ExtraKey, ...],
    ) -> Sequence:
        # its adapter's keys (engine/lora/registry.py); InvalidRequest if not loaded here
        extra_keys = self.loras.sequence_keys(extra_keys) if self.loras else no_lora(extra_keys)
        sampling = SamplingState(
            params=params,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[],
            seed=choice_seed(params.seed, index) if params.seed is not None else None,
            eos_token_ids=self.eos_token_ids,
            matcher=self.grammars.matcher(params.guided) if params.guided is not None else None,
            thinking=ThinkingTracker(params.thinking_budget) if params.thinking_budget else None,
        )
        seq = Sequence(
            seq_id=request_id if params.n == 1 else f"{request_id}#{index}",
            request_id=request_id,
            index=index,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            extra_keys=extra_keys,
        )
        if params.beam is not None:
            eos = set() if params.ignore_eos else self.eos_token_ids
            stops = set(params.stop_token_ids) | eos
            seq.beam = BeamGroup(
                params.beam,
                num_results=params.n,
                max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_token_ids)),
                stop_token_ids=frozenset(stops),
                live=[seq],
            )
        return seq

    def abort(self, request_id: str) -> list[TokenOutput]:
        """Stop a request now; its blocks are free when this returns. Unknown ids are ignored."""
        return self._aborted_all(self.scheduler.abort(request_id))

    def _aborted_all(self, seqs: list[Sequence]) -> list[TokenOutput]:
        """A beam search's sequences are its live beams, not its choices: it ends its n."""
        if seqs and seqs[0].beam is not None:
            return [self._aborted(seqs[0], index) for index in range(seqs[0].params.n)]
        return [self._aborted(s, s.index) for s in seqs]

    @staticmethod
    def _aborted(seq: Sequence, index: int) -> TokenOutput:
        """The end-of-sequence record of an aborted sequence; token_id -1 means "no new token"."""
        return TokenOutput(seq.request_id, index, -1, None, None, "abort", seq.num_prompt_tokens, 0)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        """Any of the request's sequences is here: queued, running, pulling or held."""
        return self.scheduler.has_request(request_id)

    @property
    def num_running(self) -> int:
        """Sequences holding a decode slot: in the batch, or beams parked between steps."""
        return len(self.scheduler.running) + len(self.scheduler.parked)

    @property
    def num_batched(self) -> int:
        """Sequences in the batch (no parked beams)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission."""
        return len(self.scheduler.waiting)

    @property
    def num_active_tokens(self) -> int:
        """Tokens of the queued and batched sequences."""
        return sum(s.num_tokens for s in [*self.scheduler.running, *self.scheduler.waiting])

    @property
    def kv_usage(self) -> KVCacheStats:
        return self.kv.usage

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def admission(self) -> AdmissionCounters:
        scheduler = self.scheduler
        return AdmissionCounters(
            prefix_cache_queried_tokens=scheduler.prefix_queried_tokens,
            prefix_cache_hit_tokens=scheduler.prefix_hit_tokens,
            num_admitted=scheduler.num_admitted,
            queue_seconds=scheduler.queue_seconds,
        )

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call (for the orchestrator's router)."""
        return self.kv.take_events()

    def step(self) -> list[TokenOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        seqs, logits, last_hidden, prompt_rows = self.runner.run(out)
        for rows in prompt_rows:
            self._record_prompt_logprobs(rows)
        self.num_prompt_tokens_computed += sum(
            min(c.seq.num_prompt_tokens, c.seq.num_computed_tokens + c.num_new_tokens)
            - min(c.seq.num_prompt_tokens, c.seq.num_computed_tokens)
            for c in out.chunks
        )
        seqs, logits, last_hidden, drafted, drafted_logits = _split_drafted(
            seqs, logits, last_hidden
        )
        beam_rows = [row for row, seq in enumerate(seqs) if seq.beam is not None]
        if beam_rows:  # the sampler sees the other rows only
            beams, beam_logits = [seqs[row] for row in beam_rows], logits[beam_rows]
            rows = [row for row, seq in enumerate(seqs) if seq.beam is None]
            seqs, logits = [seqs[row] for row in rows], logits[rows]
        sampled = self.sampler(logits, [seq.sampling for seq in seqs])
        self.num_generated_tokens += len(seqs)
        self.scheduler.postprocess(out, seqs, sampled)
        now = time.monotonic()
        outputs = [
            self._output(seq, row, sampled, last_hidden if seq.params.embed else None, now)
            for row, seq in enumerate(seqs)
        ]
        if drafted:
            outputs += self._verify_drafts(drafted, drafted_logits, now)
        if beam_rows:
            outputs += self._advance_beams(beams, beam_logits, now)
        return outputs

    def _verify_drafts(
        self, seqs: list[Sequence], logits: torch.Tensor, now: float
    ) -> list[TokenOutput]:
        """The speculating sequences' verdicts (engine/spec_verify.py): each emits its accepted
        proposals and the target's token, in order, up to a stop (the last one carries it)."""
        drafts = [seq.draft_token_ids for seq in seqs]
        verified = verify(logits, [seq.sampling for seq in seqs], drafts)
        self.spec.num_drafts += len(seqs)
        self.spec.num_draft_tokens += sum(len(d) for d in drafts)
        self.spec.num_accepted_tokens += sum(verified.num_accepted)
        outputs, row = [], 0
        for seq, token_ids in zip(seqs, verified.token_ids, strict=True):
            num_appended = self.scheduler.accept_drafts(seq, token_ids)
            self.num_generated_tokens += num_appended
            for j in range(num_appended):
                output = self._output(seq, row + j, verified.logprobs, None, now)
                if j < num_appended - 1:
                    output.finish_reason = None
                outputs.append(output)
            row += len(token_ids)
        return outputs

    def _advance_beams(
        self, beams: list[Sequence], logits: torch.Tensor, now: float
    ) -> list[TokenOutput]:
        """Each beam offers its best continuations and parks; a group whose live beams have all
        offered selects (a prefill-only prompt is held instead, its offer sent to the reader)."""
        temperatures = torch.tensor(
            [b.params.temperature or 1.0 for b in beams], device=logits.device
        )  # 0 (greedy) ranks the unscaled log-probs
        logprobs = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
        outputs, ready = [], {}
        for row, beam in enumerate(beams):
            group = beam.beam
            assert group is not None
            if len(beam.output_token_ids) < beam.params.min_tokens:
                logprobs[row, list(group.stop_token_ids)] = -math.inf
            best = torch.topk(logprobs[row], min(group.keep, logprobs.shape[-1]))
            candidates = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            if beam.prefill_only:
                self.scheduler.hold(beam)
                outputs.append(self._prompt_offer(beam, candidates, now))
                continue
            group.offer(beam, candidates)
            self.scheduler.park(beam)
            if group.ready:
                ready[id(group)] = group
        for group in ready.values():
            outputs += self._select(group)
        return outputs

    def _prompt_offer(
        self, beam: Sequence, candidates: list[tuple[int, float]], now: float
    ) -> TokenOutput:
        return TokenOutput(
            beam.request_id, 0, -1, None, None, None, beam.num_prompt_tokens,
            beam.num_cached_prompt_tokens, queue_s=beam.queue_s, run_s=now - beam.admitted_at,
            beam_candidates=candidates,
        )  # fmt: skip

    def _select(self, group: BeamGroup) -> list[TokenOutput]:
        """One beam-search step for a group whose beams all offered: the chosen continuations
        become the live beams (a parent chosen k times is forked k - 1 times; an unchosen beam
        is freed first, which leaves a block for each fork's copy of a partial block), or the
        search ends and its best hypotheses are the request's choices."""
        chosen = group.select()
        parents = {id(c.parent) for c in chosen}
        for beam in group.live:
            if id(beam) not in parents:
                self.scheduler.discard(beam)
        if group.finished:
            return self._beam_results(group)
        children, taken = [], set()
        for c in chosen:
            if id(c.parent) in taken:
                children.append(self._fork(c.parent, group))
            else:
                taken.add(id(c.parent))
                children.append(c.parent)
        for child, c in zip(children, chosen, strict=True):
            child.append_token(c.token_id)
            child.beam_score = c.score
            self.scheduler.resume(child)
        group.live = children
        return []

    def _fork(self, parent: Sequence, group: BeamGroup) -> Sequence:
        """A copy of the beam, sharing its KV (a partial last block copied), or with none when
        no block is free: then it computes its tokens again when admitted."""
        child = dataclasses.replace(
            parent,
            seq_id=group.new_seq_id(parent.request_id),
            token_ids=list(parent.token_ids),
            sampling=dataclasses.replace(
                parent.sampling, output_token_ids=list(parent.output_token_ids)
            ),
        )
        try:
            copy = self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
        except NoFreeBlocksError:
            child.num_computed_tokens = 0
            return child
        if copy is not None:
            source, target = copy
            self.kv_cache.pool[target].copy_(self.kv_cache.pool[source])
        return child

    def _beam_results(self, group: BeamGroup) -> list[TokenOutput]:
        """The search is over: its live beams are freed, and the best n hypotheses go out as
        the request's choices, every token at once."""
        lead = group.live[0]  # freed by now, like every live beam (_select)
        now = time.monotonic()
        outputs = []
        for index, hypothesis in enumerate(group.results()):
            last = len(hypothesis.token_ids) - 1
            for position, token_id in enumerate(hypothesis.token_ids):
                outputs.append(TokenOutput(
                    lead.request_id, index, token_id, None, None,
                    hypothesis.finish_reason if position == last else None,
                    lead.num_prompt_tokens, lead.num_cached_prompt_tokens,
                    queue_s=lead.queue_s, run_s=now - lead.admitted_at,
                ))  # fmt: skip
        self.num_generated_tokens += sum(len(h.token_ids) for h in group.results())
        return outputs

    def _record_prompt_logprobs(self, rows: PromptRows) -> None:
        """Append the log-probs of the prompt tokens these rows predict, in order (a chunk run
        again after a preemption adds nothing twice); logits a slice of rows at a time, since
        a whole prompt's would be rows x vocabulary floats. Raw model log-probs: no
        temperature, penalties or grammar."""
        seq, k = rows.seq, rows.seq.params.prompt_logprobs or 0
        wanted = min(rows.hidden.shape[0], seq.num_prompt_tokens - 1 - rows.start)
        for first in range(0, max(wanted, 0), PROMPT_LOGPROBS_SLICE):
            last = min(first + PROMPT_LOGPROBS_SLICE, wanted)
            logits = self.model.logits(rows.hidden[first:last]).float()  # (slice, vocab)
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, k, dim=-1) if k else None
            for i in range(last - first):
                position = rows.start + first + i
                if position != len(seq.prompt_logprobs):
                    continue
                target = seq.token_ids[position + 1]
                alternatives = (
                    list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
                    if top is not None
                    else []
                )
                seq.prompt_logprobs.append((float(logprobs[i, target]), alternatives))

    def _output(
        self,
        seq: Sequence,
        row: int,
        sampled: SampleResult,
        hidden: torch.Tensor | None,
        now: float,
    ) -> TokenOutput:
        """`hidden`: the sampling rows' final hidden states, when this row's request embeds."""
        wants_logprobs = seq.params.logprobs is not None
        prompt_logprobs = None
        if (
            seq.params.prompt_logprobs is not None
            and seq.index == 0
            and not seq.prompt_logprobs_sent
        ):
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return TokenOutput(
            request_id=seq.request_id,
            index=seq.index,
            token_id=sampled.token_ids[row],
            logprob=sampled.logprobs[row] if wants_logprobs and sampled.logprobs else None,
            top_logprobs=(
                sampled.top_logprobs[row] if wants_logprobs and sampled.top_logprobs else None
            ),
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            prompt_logprobs=prompt_logprobs,
            embedding=_pooled(hidden[row]) if hidden is not None else None,
            queue_s=seq.queue_s,
            run_s=now - seq.admitted_at,
        )

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if self.scheduler.has_request(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already running", "request_id")
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        vocab_size = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        params.validate(vocab_size)
        if params.beam is not None and self.config.speculative is not None:
            raise InvalidRequest(
                "beam search cannot run with speculative decoding on", "use_beam_search"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens} "
                f"({len(prompt) + params.max_tokens} in total)",
                "max_tokens" if len(prompt) < self.max_model_len else "prompt",
            )
        needed_blocks = -(-(len(prompt) + params.max_tokens) // self.config.block_size)
        if params.beam is not None:  # every beam may end up with its own blocks
            needed_blocks *= params.beam.width
        if needed_blocks > self.config.num_blocks:
            raise InvalidRequest(
                f"the request needs {needed_blocks} KV blocks; "
                f"the cache has {self.config.num_blocks}",
                "max_tokens",
            )


def _split_drafted(
    seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor
) -> tuple[list[Sequence], torch.Tensor, torch.Tensor, list[Sequence], torch.Tensor]:
    """The runner's rows apart: the sequences without proposals (a row each: logits, hidden),
    and the speculating ones with their 1 + len(proposals) logits rows each."""
    if not any(seq.draft_token_ids for seq in seqs):
        return seqs, logits, hidden, [], logits[:0]
    plain, plain_rows, drafted, drafted_rows = [], [], [], []
    row = 0
    for seq in seqs:
        num_rows = 1 + len(seq.draft_token_ids)
        if seq.draft_token_ids:
            drafted.append(seq)
            drafted_rows.extend(range(row, row + num_rows))
        else:
            plain.append(seq)
            plain_rows.append(row)
        row += num_rows
    return plain, logits[plain_rows], hidden[plain_rows], drafted, logits[drafted_rows]


def _pooled(hidden: torch.Tensor) -> bytes:
    """A final hidden state as an embedding: L2-normalized in float32, as little-endian bytes."""
    vector = torch.nn.functional.normalize(hidden.float(), dim=-1)
    return vector.cpu().numpy().astype("<f4").tobytes()
