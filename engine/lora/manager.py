"""The engine's loaded LoRA adapters: each in a slot of every targeted layer's stacked matrices,
and the step's slot per token that the layers read (one forward for a batch of mixed adapters).

A fused layer of S slices (qkv_proj: q, k, v; gate_up_proj: gate, up) holds, per slot:

    a (R = S * max_rank, in)      slice i's A in rows [i * max_rank, i * max_rank + r)
    b (out, R)                    slice i's B in its output rows, columns of its A's rows only:

                   A_q rows   A_k rows   A_v rows
        q outputs [  B_q         0          0    ]
        k outputs [   0         B_k         0    ]
        v outputs [   0          0         B_v   ]

so `b @ (a @ x)` is each slice's B_i A_i x, the zeros costing S times the (small) expand. An
adapter that leaves a module out, or a rank under max_rank, leaves zeros: no contribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.protocol import lora_name_of
from engine.kernels.lora import lora_add
from engine.linear import Linear
from engine.lora.adapter import TARGETS, LoRAAdapter

if TYPE_CHECKING:
    from engine.sequence import Sequence

BASE_SLOT = -1  # a token of the base model


@dataclass(slots=True)
class LoRABatch:
    """The step's adapter slot of each token, shared by every LoRA layer of a model."""

    slot_by_name: dict[str, int] = field(default_factory=dict)  # the loaded adapters
    slots: torch.Tensor | None = None  # (num_tokens,) int32; None: no adapter in this step

    def set(self, seqs: list[Sequence], seq_index: list[int], device: str) -> None:
        """Token i belongs to seqs[seq_index[i]]; each sequence's adapter is named in its
        prefix-cache keys. None when every token is the base model's, so the layers skip LoRA
        entirely (and the C decode step may run)."""
        names = [lora_name_of(seq.extra_keys) for seq in seqs]
        if all(name is None for name in names):
            self.slots = None
            return
        by_seq = [BASE_SLOT if n is None else self.slot_by_name[n] for n in names]
        self.slots = torch.tensor([by_seq[i] for i in seq_index], dtype=torch.int32, device=device)


@dataclass(slots=True, eq=False)
class LoRAStack:
    """One layer's matrices of every slot (module docstring)."""

    a: torch.Tensor  # (max_loras, num_slices * max_rank, in_features) float32
    b: torch.Tensor  # (max_loras, out_features, num_slices * max_rank) float32
    slice_sizes: tuple[int, ...]  # the fused output's parts (q, k, v), summing to out_features
    scales: torch.Tensor  # (max_loras,) float32, shared by the model's layers
    batch: LoRABatch

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (num_tokens, out_features) += each token's adapter's update of x; in place."""
        if self.batch.slots is not None:
            lora_add(out, x, self.a, self.b, self.scales, self.batch.slots)


class LoRAManager:
    """Adapters by name, each in one of `max_loras` slots; every slot is resident, so any mix of
    loaded adapters runs in one batch."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        device = next(model.parameters()).device
        self.batch = LoRABatch()
        self.scales = torch.zeros(max_loras, device=device)
        self.layers: dict[str, LoRAStack] = {}
        targets = {layer for layer, _ in TARGETS.values()}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.split(".", 3)[-1] in targets:
                sizes = _slice_sizes(model, name, module)
                r = len(sizes) * max_rank
                module.lora = self.layers[name] = LoRAStack(
                    torch.zeros(max_loras, r, module.in_features, device=device),
                    torch.zeros(max_loras, module.out_features, r, device=device),
                    sizes, self.scales, self.batch,
                )  # fmt: skip
        model.lora_batch = self.batch
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots = self.batch.slot_by_name  # name -> slot

    def add(self, adapter: LoRAAdapter) -> int:
        """Write the adapter into a free slot; ValueError when none is free or it does not fit
        this model (nothing changed then)."""
        if adapter.name in self.slots:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if not free:
            raise ValueError(f"LoRA adapter {adapter.name!r}: all max_loras={self.max_loras} "
                             f"slots are taken; unload one first")  # fmt: skip
        self._check_fits(adapter)
        slot = free[0]
        for stack in self.layers.values():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
        for (layer, part), (a, b) in adapter.weights.items():
            stack = self.layers[layer]
            rank, offset = a.shape[0], sum(stack.slice_sizes[:part])
            rows = slice(part * self.max_rank, part * self.max_rank + rank)
            stack.a[slot, rows] = a
            stack.b[slot, offset : offset + stack.slice_sizes[part], rows] = b
        self.scales[slot] = adapter.scale
        self.adapters[adapter.name] = adapter
        self.slots[adapter.name] = slot
        return slot

    def remove(self, name: str) -> None:
        if name not in self.slots:
            raise KeyError(name)
        del self.slots[name], self.adapters[name]

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        for (layer, part), (a, b) in adapter.weights.items():
            stack = self.layers.get(layer)
            if stack is None or part >= len(stack.slice_sizes):
                raise ValueError(f"LoRA adapter {adapter.name!r}: targets {layer}, which this "
                                 f"model does not have")  # fmt: skip
            if a.shape[1] != stack.a.shape[2] or b.shape[0] != stack.slice_sizes[part]:
                shapes = f"A {tuple(a.shape)}, B {tuple(b.shape)}"
                raise ValueError(f"LoRA adapter {adapter.name!r}: {layer} has the wrong shape "
                                 f"({shapes}): made for another base model?")  # fmt: skip


def _slice_sizes(model: nn.Module, name: str, module: Linear) -> tuple[int, ...]:
    """The fused layer's parts: q, k, v sizes; gate, up; or the one output."""
    if name.endswith("qkv_proj"):
        attn = model.get_submodule(name.removesuffix(".qkv_proj"))
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return (q, kv, kv)
    if name.endswith("gate_up_proj"):
        return (module.out_features // 2, module.out_features // 2)
    return (module.out_features,)
