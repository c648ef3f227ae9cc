"""The model's linear layers, run by oneDNN on CPU.

torch's CPU `linear` calls MKL's sgemm, which on this project's AMD EPYC hosts takes a generic
code path: at decode shapes (8 to 32 rows against a 576 x 49,152 LM head) it reached 25 GFLOP/s
where oneDNN's matmul, also inside torch (`torch.ops.mkldnn._linear_pointwise`, what inductor
emits for linear layers on CPU), reached 50. The whole SmolLM2 decode step ran 1.6x faster
with it (bench/engine.py). The results differ from MKL's only in summation order (about 1e-5
relative); greedy tokens matched transformers' in every parity test.

Elsewhere (GPU, a torch built without oneDNN, inputs that are not 2-D) it is torch's linear.
"""

from __future__ import annotations

import torch
from torch import nn

ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ONEDNN and x.dim() == 2 and x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return super().forward(x)
