"""The model's tokenizer without transformers: `tokenizers` plus what tokenizer_config.json says.

The frontend and the postproc workers start fast and never import torch or transformers, yet
they must encode, decode and name special tokens exactly as the model's Hugging Face tokenizer
does. This wraps `tokenizers.Tokenizer` (tokenizer.json) and reads the rest (special tokens,
eos / pad / bos, the chat template) from tokenizer_config.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other bytes, in increasing order, take the
    code points 256, 257, ...
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    for offset, b in enumerate(shifted):
        table[chr(256 + offset)] = b
    return table


def _uses_byte_level(decoder: object) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders") or ())


def _token_content(value: object) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode / decode with the model's vocabulary; special ids as tokenizer_config.json says."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        added_tokens: dict[int, bool],
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        byte_level: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """`added_tokens`: id -> whether it is special (skipped by skip_special_tokens)."""
        self._backend = backend
        self._byte_level = byte_level
        self._token_bytes: dict[int, bytes] = {}
        self.chat_template = chat_template
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.added_token_ids = frozenset(added_tokens)
        # Like transformers' all_special_ids: added tokens marked special, plus eos / pad / bos.
        special = {i for i, is_special in added_tokens.items() if is_special}
        special.update(i for i in (eos_token_id, pad_token_id, bos_token_id) if i is not None)
        self.special_ids = frozenset(special)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary spelling bounds it)."""
        return max(
            (len(token) for token in self._backend.get_vocab(with_added_tokens=True)), default=1
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS/EOS inserted (chat templates already carry their markers)."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            token_ids = [i for i in token_ids if i not in self.special_ids]
        return str(self._backend.decode(list(token_ids), skip_special_tokens=False))

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry itself (byte-level BPE spells a space 'Ġ'); None if unknown."""
        token = self._backend.id_to_token(token_id)
        return None if token is None else str(token)

    def token_to_id(self, token: str) -> int | None:
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token: part of a UTF-8 character for some byte-level tokens."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs; a token holding part of a character shows U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_token_bytes(self, token_id: int) -> bytes:
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.added_token_ids:
            return piece.encode()
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode()
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker is a space


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json + tokenizer_config.json)."""
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    raw = tokenizer_file.read_text(encoding="utf-8")
    spec = json.loads(raw)
    backend = tokenizers.Tokenizer.from_str(raw)
    config_file = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = (
        json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    )
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object")

    # tokenizer.json lists every added token; tokenizer_config.json, if present, has the last word.
    added = {int(t["id"]): bool(t.get("special")) for t in spec.get("added_tokens") or ()}
    for token_id, record in (config.get("added_tokens_decoder") or {}).items():
        added[int(token_id)] = bool(record.get("special"))

    def config_token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        return None if content is None else backend.token_to_id(content)

    return Tokenizer(
        backend,
        added_tokens=added,
        eos_token_id=config_token_id("eos_token"),
        pad_token_id=config_token_id("pad_token"),
        bos_token_id=config_token_id("bos_token"),
        byte_level=_uses_byte_level(spec.get("decoder")),
        chat_template=_chat_template(model_dir, config),
    )


def _chat_template(model_dir: Path, config: dict[str, object]) -> str | None:
    """The default chat template: tokenizer_config.json's, or chat_template.jinja (newer models)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the one named "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = model_dir / "chat_template.jinja"
    return jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
