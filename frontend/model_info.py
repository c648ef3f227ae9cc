"""What the frontend knows about the served model, read once at start from its directory (no
torch, no transformers): name, tokenizer, limits, and the llguidance tokenizer for checking
constraints (built on first use)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import llguidance

from common.builtin_models import builtin_model, resolve_model_dir
from common.config import ClusterConfig, context_length
from common.errors import InvalidRequest
from common.guided import ll_tokenizer
from common.hf_config import language_model_config
from common.parser_choice import HARMONY_MODEL_TYPES, ToolParserName, tool_parser_for
from common.tokenizer import Tokenizer, load_tokenizer
from frontend.images import VisionInfo
from frontend.sampling import SamplingDefaults

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    name: str  # the `model:` value clients must send
    model_dir: Path
    model_type: str  # config.json's, e.g. "qwen3": picks the reasoning parser
    # the tool-call format: parsed in the postproc worker, taught by the prompt
    tool_parser: ToolParserName
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    hidden_size: int  # the length of its embeddings (POST /v1/embeddings)
    eos_token_ids: tuple[int, ...]
    sampling_defaults: SamplingDefaults  # what omitted sampling fields mean
    max_token_chars: int  # the longest vocabulary entry: no token covers more characters
    speculative: bool = False  # the cluster's decoders speculate: beam search is refused
    vision: VisionInfo | None = None  # a vision-language model's images (frontend/images.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """A 400 before tokenizing for text that cannot fit the context whatever its tokens:
        tokenizing megabytes only to refuse them would hold a core for seconds."""
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise InvalidRequest(
                f"the prompt has {num_chars} characters; this model's context of "
                f"{self.max_model_len} tokens holds at most {limit}",
                param,
            )

    @property
    def harmony(self) -> bool:
        """Prompts in the harmony format (gpt-oss: common/harmony.py), not the chat template."""
        return self.model_type in HARMONY_MODEL_TYPES

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        return ll_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)


def load_model_info(config: ClusterConfig) -> ModelInfo:
    model_dir = resolve_model_dir(config.model, config.dtype)
    hf_config = json.loads((model_dir / "config.json").read_text())
    # a multimodal checkpoint (Gemma 3) keeps the language model's sizes in text_config, and a
    # checkpoint may leave fields to its config class's defaults
    text_config = language_model_config(hf_config)
    model_type = str(hf_config.get("model_type", ""))
    builtin = builtin_model(config.model)
    if model_type in HARMONY_MODEL_TYPES and config.tool_parser not in (None, "harmony"):
        logger.warning("tool_parser %s is not used: %s's tool calls are harmony's channels",
                       config.tool_parser, model_type)  # fmt: skip
    eos = hf_config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    tokenizer = load_tokenizer(model_dir)
    return ModelInfo(
        name=config.model,
        model_dir=model_dir,
        model_type=model_type,
        # harmony's calls are its channels: no other tool format applies to such a model
        tool_parser="harmony"
        if model_type in HARMONY_MODEL_TYPES
        else config.tool_parser or (builtin and builtin.tool_parser) or tool_parser_for(model_type),
        tokenizer=tokenizer,
        max_model_len=context_length(
            int(text_config["max_position_embeddings"]),
            config.max_model_len,
            config.kv_cache.num_blocks,
            config.kv_cache.block_size,
        )[0],  # fmt: skip
        vocab_size=int(text_config["vocab_size"]),
        hidden_size=int(text_config["hidden_size"]),
        eos_token_ids=eos_ids,
        sampling_defaults=SamplingDefaults.of_model(model_dir)
        if config.frontend.sampling_defaults == "model"
        else SamplingDefaults(),
        max_token_chars=tokenizer.max_token_chars(),
        speculative=config.speculative is not None,
        vision=VisionInfo.of_model(model_dir, hf_config, tokenizer),
    )
