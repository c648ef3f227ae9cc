"""The model's linear layers, run by oneDNN on CPU with weights packed once at load.

torch's CPU `linear` calls MKL's sgemm, which on this project's AMD EPYC hosts takes a generic
code path; oneDNN's matmul, also inside torch (`torch.ops.mkldnn._linear_pointwise`, what
inductor emits for linear layers on CPU), is faster at every decode shape, and faster again with
the weight already in its blocked layout (`_reorder_linear_weight`), since an unpacked weight is
reordered on every call. The 30 layers of SmolLM2 (425 MB of float32 weights, one thread):
F.linear 33 / 62 ms at 1 / 8 rows, oneDNN 24 / 40 ms, packed 22 / 28 ms, that is 19.7 and
15 GB/s (one core reads up to ~35 GB/s here, bench/peers.py). Results differ from MKL's only
in summation order (about 1e-5 relative); greedy tokens matched transformers' in every parity
test.

Packing is for CPU tensors of float32, or bfloat16 where oneDNN runs it on this CPU (AVX-512
or AVX-NE-CONVERT; an AVX2-only host refuses to pack bfloat16 and keeps torch's linear), in a
torch with oneDNN; elsewhere (GPU) the layers are torch's linear. A packed weight is an opaque
oneDNN tensor: nothing else reads it (a tied LM head keeps the embedding's plain tensor for
lookups and packs a copy).
"""

from __future__ import annotations

import torch
from torch import nn

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
PACKING_ROWS = 8  # the batch size oneDNN picks its blocking for; any row count runs


class Linear(nn.Linear):
    packed = False

    def pack(self) -> None:
        """Replace the weight with oneDNN's packed copy (CPU, float32 / bfloat16 only)."""
        weight = self.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return super().forward(x)


def can_pack(device: str, dtype: torch.dtype) -> bool:
    if device != "cpu" or dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
