"""A weight-only quantized (N, K) matrix in groups along K, as every loader hands it over.

Each row's K values are cut into groups of `group_size`; a group's weights are
`scale * value` (8 bits, signed values) or `scale * value + min` (4 bits, values 0..15). The
formats users bring map onto this without loss: GGUF's Q8_0 (groups of 32, one scale), Q4_0
(32, min = -8 scale), Q4_1 (32, scale and min), Q4_K (sub-blocks of 32: d * sc and
-dmin * m), Q6_K (sub-blocks of 16, 6-bit values as signed bytes, d * sc), and GPTQ / AWQ /
compressed-tensors int4 with zero points (min = -scale * zero) or int8 per channel (one group
of K). Scales and mins are float32: every product above (a float16 times a small integer) is
exact in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    bits: int  # 8 or 4
    group_size: int  # K is a multiple of it
    values: torch.Tensor  # (N, K): int8 (8 bits), or uint8 in [0, 15] (4 bits)
    scales: torch.Tensor  # (N, K // group_size) float32
    mins: torch.Tensor | None  # (N, K // group_size) float32 for 4 bits; None for 8

    def __post_init__(self) -> None:
        n, k = self.values.shape
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights are not supported (4 or 8)")
        if k % self.group_size:
            raise ValueError(f"K={k} is not a multiple of the group size {self.group_size}")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {groups}, not {tuple(self.scales.shape)}")
        if self.bits == 8 and (self.values.dtype != torch.int8 or self.mins is not None):
            raise ValueError("8-bit weights: int8 values and no mins")
        if self.bits == 4:
            if self.values.dtype != torch.uint8 or self.mins is None:
                raise ValueError("4-bit weights: uint8 values in [0, 15] and mins")
            if tuple(self.mins.shape) != groups or self.mins.dtype != torch.float32:
                raise ValueError(f"mins must be float32 {groups}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) matrix: the reference every kernel is held to."""
        n, k = self.shape
        grouped = self.values.float().reshape(n, k // self.group_size, self.group_size)
        weight = grouped * self.scales.unsqueeze(-1)
        if self.mins is not None:
            weight = weight + self.mins.unsqueeze(-1)
        return weight.reshape(n, k)

    @property
    def nbytes(self) -> int:
        """What a decode step streams for it: packed values plus scales and mins."""
        n, k = self.shape
        extra = self.scales.numel() * 4 + (0 if self.mins is None else self.mins.numel() * 4)
        return n * k * self.bits // 8 + extra


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Matrices stacked along N (q, k, v as the fused qkv projection): one quantized matrix when
    they share bits and group size (a file quantized one way, as the common ones are)."""
    first = parts[0]
    if any((p.bits, p.group_size) != (first.bits, first.group_size) for p in parts):
        kinds = sorted({f"{p.bits}-bit groups of {p.group_size}" for p in parts})
        raise ValueError(f"fused projections quantized differently ({', '.join(kinds)})")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    return QuantizedWeight(
        bits=first.bits,
        group_size=first.group_size,
        values=torch.cat([p.values for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=mins,
    )
