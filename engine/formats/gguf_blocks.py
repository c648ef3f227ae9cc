"""GGUF's quantized blocks unpacked into a QuantizedWeight without loss, vectorised over the whole
matrix (no loop over blocks). The layouts are llama.cpp's (ggml-common.h, ggml-quants.c); the tests
hold every type to gguf-py's own `gguf.quants.dequantize` on the same bytes.

A quantized (N, K) GGUF matrix stores each row as K / block_size blocks of type_size bytes:

    type  bytes/values  block                                      QuantizedWeight
    Q8_0   34 / 32      d:f16 q[32]:i8              w = d q          8 bits, group 32, scale d
    Q4_0   18 / 32      d:f16 qs[16]                w = d (q - 8)    4 bits, group 32, d, min -8 d
    Q5_0   22 / 32      d:f16 qh:u32 qs[16]         w = d (q - 16)   8 bits, group 32, values
                                                                     q - 16, scale d
    Q4_1   20 / 32      d:f16 m:f16 qs[16]          w = d q + m      4 bits, group 32, d, min m
    Q4_K  144 / 256     d:f16 dmin:f16 sm[12] qs[128]                4 bits, group 32,
                        sub-block s (32 values): w = d sc_s q - dmin m_s    d sc_s, min -dmin m_s
    Q6_K  210 / 256     ql[128] qh[64] sc[16]:i8 d:f16               8 bits, group 16,
                        sub-block s (16 values): w = d sc_s (q - 32)        values q - 32, d sc_s

Nibble order: Q4_0 / Q4_1 keep value j in the low nibble of qs[j] and value j + 16 in its high
nibble, Q5_0 too with value j's fifth bit bit j of qh (little-endian); Q4_K does the same per 64
values (32 bytes: low nibbles first, then high). Q4_K's sm packs
eight 6-bit scales and eight 6-bit mins (sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7,
sub-blocks 4-7 as a nibble of bytes 8-11 plus the top 2 bits of bytes 0-3 / 4-7). Q6_K's 6-bit
q is 4 bits of ql and 2 of qh; each half of 128 values reads 64 ql bytes and 32 qh bytes, see
`_q6_k`.

Every scale and min above is a float16 times a small integer, exact in float32, so the float32
weights `QuantizedWeight.dequantize` computes equal gguf's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.quant.weight import QuantizedWeight

Q = GGMLQuantizationType
# (values (N, blocks, block_size), scales and mins (N, blocks, groups per block))
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at `offset` of every block, as float32: (N, blocks)."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2 n) values: the low nibbles, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> Unpacked:
    values = blocks[..., 2:].view(np.int8).copy()  # (N, blocks, 32)
    return values, _f16(blocks, 0)[..., None], None


def _q4_0(blocks: np.ndarray) -> Unpacked:
    scale = _f16(blocks, 0)[..., None]
    return _nibbles(blocks[..., 2:]), scale, np.float32(-8.0) * scale


def _q4_1(blocks: np.ndarray) -> Unpacked:
    return _nibbles(blocks[..., 4:]), _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]


def _q5_0(blocks: np.ndarray) -> Unpacked:
    """Stored as 8-bit values (q - 16 in -16..15): the 4-bit kernels have no fifth bit. llama.cpp
    writes Q5_0 where a Q4_K_M file's rows are not a multiple of 256 (Qwen2.5-0.5B's 896)."""
    qh = blocks[..., 2:6].copy().view("<u4")  # (N, blocks, 1)
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (N, blocks, 32)
    values = (_nibbles(blocks[..., 6:]) | (fifth << 4)).astype(np.int8) - np.int8(16)
    return values, _f16(blocks, 0)[..., None], None


def _q4_k(blocks: np.ndarray) -> Unpacked:
    n, num_blocks = blocks.shape[:2]
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sm = blocks[..., 4:16]  # (N, blocks, 12)
    low_sc, low_m, high = sm[..., 0:4], sm[..., 4:8], sm[..., 8:12]
    sc = np.concatenate([low_sc & 0x3F, (high & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([low_m & 0x3F, (high >> 4) | ((low_m >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(n, num_blocks, 4, 32)  # 4 chunks of 64 values
    values = _nibbles(qs).reshape(n, num_blocks, 256)
    return values, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q6_k(blocks: np.ndarray) -> Unpacked:
    n, num_blocks = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(n, num_blocks, 2, 64)  # per half of 128 values
    qh = blocks[..., 128:192].reshape(n, num_blocks, 2, 32)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # (N, blocks, 16)
    # Within a half, value 32 k + l (k = 0..3, l = 0..31): ql[l] low nibble, ql[l + 32] low,
    # ql[l] high, ql[l + 32] high for k = 0..3; its top 2 bits are bits 2k, 2k + 1 of qh[l].
    low = np.stack(
        [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2
    )  # (N, blocks, 2, 4, 32)
    high = np.stack([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-2)
    values = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return values.reshape(n, num_blocks, 256), _f16(blocks, 208)[..., None] * sc, None


# qtype -> (bits, group_size, unpack)
LAYOUTS: dict[GGMLQuantizationType, tuple[int, int, Callable[[np.ndarray], Unpacked]]] = {
    Q.Q8_0: (8, 32, _q8_0),
    Q.Q4_0: (4, 32, _q4_0),
    Q.Q4_1: (4, 32, _q4_1),
    Q.Q5_0: (8, 32, _q5_0),
    Q.Q4_K: (4, 32, _q4_k),
    Q.Q6_K: (8, 16, _q6_k),
}


def unpack_blocks(rows: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """One quantized GGUF matrix, (N, K / block_size * type_size) bytes as GGUFReader maps it,
    as the (N, K) QuantizedWeight it stands for."""
    if qtype not in LAYOUTS:
        supported = ", ".join(t.name for t in LAYOUTS)
        raise ValueError(f"GGUF {qtype.name} matrices are not supported ({supported})")
    bits, group_size, unpack = LAYOUTS[qtype]
    type_size = GGML_QUANT_SIZES[qtype][1]
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[1] % type_size:
        raise ValueError(f"{qtype.name} rows must be (N, a multiple of {type_size}) bytes")
    n = rows.shape[0]
    blocks = np.asarray(rows).reshape(n, -1, type_size)  # (N, K / block_size, type_size)
    values, scales, mins = unpack(blocks)
    return QuantizedWeight(
        bits=bits,
        group_size=group_size,
        values=torch.from_numpy(np.ascontiguousarray(values).reshape(n, -1)),
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(n, -1)),
        mins=None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(n, -1)),
    )
