"""Rotary embedding tables: the inverse frequencies of each scaling kind, as Hugging Face computes
them, turned once into cos / sin tables for every position the engine serves.

    default   theta ** (-2i / d)
    linear    default / factor
    llama3    Llama 3.1's smooth interpolation between low and high frequency bands
    yarn      YaRN (gpt-oss): interpolated below a ramp, extrapolated above, cos/sin scaled by
              the attention factor (0.1 ln(factor) + 1)
    longrope  Phi-3: default divided per frequency by short_factor, or by long_factor once a
              sequence is longer than the pretraining length; cos/sin scaled by
              sqrt(1 + ln(factor) / ln(original_max))

A longrope table holds both: rows [0, max) with the short factors, rows [max, 2 max) with the
long ones, and a sequence past the original length reads the second half (see
`RotaryEmbedding.table_positions`). The tables are (positions, rotary_dim) float32, cat(freqs,
freqs) as the rotate-half form reads them; rotary_dim < head_dim rotates a head's first
rotary_dim values only (Phi-4-mini).
"""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inv_freq(rope: RopeConfig, dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim / 2,), the factor cos and sin are scaled by)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (rope.theta**exponents)
    if rope.kind == "default":
        return base, 1.0
    if rope.kind == "linear":
        return base / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(base, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, dim)
    if rope.kind == "longrope":
        return _longrope(rope, dim, long)
    raise ValueError(f"rope type {rope.kind!r} is not supported")


def _llama3(base: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / rope.factor, base)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, original = rope.factor, rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    freqs = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return freqs, attention_factor


def _longrope(rope: RopeConfig, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    factor, original = rope.factor, rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope.theta**exponents), attention_factor


def cos_sin_tables(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (positions, rotary_dim) float32; longrope: 2 * max_positions rows."""
    dim = rope.rotary_dim or head_dim
    halves = [False, True] if rope.kind == "longrope" else [False]
    cos, sin = [], []
    positions = torch.arange(max_positions, dtype=torch.float32)
    for long in halves:
        freqs, scaling = inv_freq(rope, dim, long)
        emb = torch.outer(positions, freqs)
        emb = torch.cat([emb, emb], dim=-1)  # (max_positions, dim)
        cos.append(emb.cos() * scaling)
        sin.append(emb.sin() * scaling)
    return torch.cat(cos), torch.cat(sin)
