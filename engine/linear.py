"""The model's linear layers on the CPU, with weights repacked once at load for the kernel that
runs them fastest here.

A decode step multiplies a few rows by every weight once: its time is how fast the weights
stream from memory. torch's CPU `linear` calls MKL's sgemm, which on this project's AMD EPYC
hosts takes a generic code path; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, what
inductor emits for linear layers on CPU) with its weight in oneDNN's blocked layout was the best
of torch's (SmolLM2's 30 layers, 425 MB of float32, one thread, session 9's AVX-512 host:
F.linear 33 / 62 ms at 1 / 8 rows, oneDNN 24 / 40 ms, packed 22 / 28 ms). Our own panel
kernel (kernels/cpu_linear.c) streams them faster still where it was measured, on an AVX2-only
host whose core reads ~15.7 GB/s: see `choose_layout`.

Layouts:
- "panels": cpu_linear.c's column panels (float32 weights, or bfloat16 on a CPU where oneDNN
  has no bfloat16); the kernel computes in float32 and rounds once to the model's dtype.
- "onednn": oneDNN's packed layout (bfloat16 where oneDNN runs it: AVX-512 BF16 / AVX-NE-CONVERT,
  or where the C kernels did not build).
- "plain": torch's linear (GPU, float16, no oneDNN).
Beside oneDNN's bfloat16 layout, the layers keep a second copy for the C decode step (model.py),
which runs decode-only batches as one call: in cpu_linear.c's bfloat16 pairs where the kernels
have AVX512-BF16's dot products (SmolLM2, one thread, a step at 1 / 4 / 8 / 32 sequences: 19 /
24 / 34 / 105 ms, against oneDNN's 27 / 30 / 39 / 103; from 8 rows in AMX tiles where the CPU
has them), else in panels for batches of up to four (widened to float32, they lose to
oneDNN's dot products from five rows).
- "quantized": a weight-only quantized matrix (a GGUF file's; engine/quant/weight.py) kept as
  stored and packed for its kernel: cpu_quant.c on the CPU, Triton's quant_matmul on a GPU;
  where neither runs (no C compiler), dequantized to the model's dtype at load.
Results differ from MKL's only in summation order (about 1e-6 relative); greedy tokens matched
transformers' in every parity test. A packed weight is an opaque copy: nothing else reads it (a
tied LM head keeps the embedding's plain tensor for lookups and packs a copy).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from engine.kernels import cpu_kernels, cpu_quant
from engine.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from engine.kernels.cpu_quant import PackedQuant
    from engine.kernels.quant_matmul import TritonQuant
    from engine.lora.manager import LoRAStack

Layout = Literal["plain", "onednn", "panels", "quantized"]
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
PACKING_ROWS = 8  # the batch size oneDNN picks its blocking for; any row count runs


class Linear(nn.Linear):
    layout: Layout = "plain"
    # beside "onednn": (pairs or panels, float32 bias) for the C decode step (module docstring)
    decode_copy: tuple[torch.Tensor, torch.Tensor | None] | None = None

    # a quantized matrix: (bits, group size, the model's dtype) from quantize() until `pack`
    # packs it for its kernel
    quantized: tuple[int, int, torch.dtype] | None = None
    packed: PackedQuant | TritonQuant | None = None
    # the loaded LoRA adapters' matrices for this layer (engine/lora/manager.py), added to the
    # output of the tokens whose adapter the step's batch names
    lora: LoRAStack | None = None

    def quantize(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        """Take a quantized matrix in place of the float weight (at load, before the float
        tensors are assigned); `pack` packs it on the device the model was moved to."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.shape} matrix for a ({self.out_features}, "
                             f"{self.in_features}) layer")  # fmt: skip
        del self.weight
        self.quantized = (weight.bits, weight.group_size, dtype)
        # as buffers, so that .to(device) moves them with the model
        self.register_buffer("q_values", weight.values, persistent=False)
        self.register_buffer("q_scales", weight.scales, persistent=False)
        self.register_buffer("q_mins", weight.mins, persistent=False)

    def pack(self, layout: Layout, keep_decode_copy: bool = False) -> None:
        """Replace the weight with its copy in `layout` (see the module docstring)."""
        if self.quantized is not None:
            self._pack_quantized(layout)
            return
        weight = self.weight.detach()
        if keep_decode_copy and layout == "onednn":
            bias = None if self.bias is None else self.bias.detach().float()
            self.decode_copy = (_decode_copy(weight), bias)
        if layout == "panels":
            packed = cpu_kernels.pack_panels(weight)
            if self.bias is not None:  # the kernel adds a float32 bias
                bias = self.bias.detach().float()
                del self.bias
                self.register_buffer("bias", bias, persistent=False)
        elif layout == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)
        else:
            return
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        self.layout = layout

    def _pack_quantized(self, layout: Layout) -> None:
        assert self.quantized is not None
        bits, group_size, dtype = self.quantized
        device = self.q_values.device
        weight = QuantizedWeight(bits, group_size, self.q_values, self.q_scales, self.q_mins)
        del self.q_values, self.q_scales, self.q_mins
        self.quantized = None
        if device.type == "cpu" and cpu_kernels.library() is not None:
            self.packed = cpu_quant.pack_quantized(weight)
        elif device.type == "cuda":
            from engine.kernels.quant_matmul import pack_for_triton

            self.packed = pack_for_triton(weight)
        else:  # no kernel for it here: the float matrix, in the layout the model's dtype takes
            self.weight = nn.Parameter(weight.dequantize().to(dtype), requires_grad=False)
            self.pack(layout)
            return
        if self.bias is not None:  # both kernels add a float32 bias
            bias = self.bias.detach().float()
            del self.bias
            self.register_buffer("bias", bias, persistent=False)
        self.layout = "quantized"

    def decode_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """What the C decode step reads, the weight (panels or pairs) and the float32 bias,
        where the layer has them."""
        if isinstance(self.packed, cpu_quant.PackedQuant):
            return self.packed.data, self.bias
        if self.layout == "panels":
            return self.weight, self.bias
        return self.decode_copy

    def streamed_weight(self) -> torch.Tensor | None:
        """The matrix a CPU decode step (or, for the LM head, `forward`) streams from memory,
        where it is one of this project's own layouts (engine/weight_arena.py moves it)."""
        if isinstance(self.packed, cpu_quant.PackedQuant):
            return self.packed.data
        if self.layout == "panels":
            return self.weight
        return None if self.decode_copy is None else self.decode_copy[0]

    def replace_streamed_weight(self, moved: torch.Tensor) -> None:
        """Read `moved`, a copy of streamed_weight() elsewhere in memory, from now on."""
        if isinstance(self.packed, cpu_quant.PackedQuant):
            self.packed = dataclasses.replace(self.packed, data=moved)
        elif self.layout == "panels":
            self.weight = moved  # a buffer (pack registered it so): reassigned in place
        else:
            assert self.decode_copy is not None
            self.decode_copy = (moved, self.decode_copy[1])

    def quant_spec(self) -> tuple[int, int]:
        """(bits, group size) of a matrix cpu_quant.c runs; (0, 0) for a float one."""
        if isinstance(self.packed, cpu_quant.PackedQuant):
            return self.packed.bits, self.packed.group_size
        return 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base_forward(x)
        if self.lora is not None and self.lora.batch.slots is not None:
            self.lora.add_to(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]))
        return out

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "plain":
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        if isinstance(self.packed, cpu_quant.PackedQuant):
            out = cpu_quant.quant_linear(rows, self.packed, self.bias).to(x.dtype)
        elif self.packed is not None:
            from engine.kernels.quant_matmul import quant_matmul

            out = quant_matmul(rows, self.packed, self.bias)
        elif self.layout == "panels":
            out = cpu_kernels.panel_linear(rows, self.weight, self.bias, self.out_features)
            out = out.to(x.dtype)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _decode_copy(weight: torch.Tensor) -> torch.Tensor:
    """The C decode step's copy: bfloat16 pairs for its dot products where the CPU has them
    (AVX512-BF16), else panels."""
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        if cpu_kernels.bf16_pairs_available():
            return cpu_kernels.pack_pairs(weight)
    return cpu_kernels.pack_panels(weight)


def choose_layout(device: str, dtype: torch.dtype) -> Layout:
    """Panels for float32 (11-14 GB/s at 1-8 rows where oneDNN's packed matmul read 8.8, and
    no slower at prefill sizes: linear.py's docstring), and for bfloat16 where oneDNN has no
    bfloat16 kernels (an AVX2-only CPU; else oneDNN's native bfloat16 dot products win)."""
    if device != "cpu" or dtype not in ONEDNN_DTYPES:
        return "plain"
    onednn_runs = torch.backends.mkldnn.is_available() and (
        dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
    kernels = cpu_kernels.library() is not None
    if kernels and (dtype == torch.float32 or not onednn_runs):
        return "panels"
    return "onednn" if onednn_runs else "plain"


def pack_linear_layers(model: nn.Module, layout: Layout, decode_copy: bool = False) -> None:
    """`decode_copy`: beside "onednn", the C decode step's copy of every layer but the LM head
    (which the C step leaves to torch)."""
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(layout, keep_decode_copy=decode_copy and module is not head)


def drop_decode_copies(model: nn.Module) -> None:
    """Free the C decode step's copies where the step will not run (the torch attention
    backend): nothing else reads them."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.decode_copy = None
