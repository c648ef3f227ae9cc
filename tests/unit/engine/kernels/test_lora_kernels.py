"""The batched LoRA matmul: cpu_lora.c and the Triton kernel against the torch reference, on a
batch mixing several adapters and base-model tokens (engine/kernels/lora.py's contract).

Without a GPU the Triton kernel runs in the interpreter, which must be switched on before triton
is first imported (test_triton_quant.py's docstring: the same rerun-in-a-subprocess fallback).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.kernels import cpu_kernels, lora_triton  # noqa: E402
from engine.kernels.lora import lora_add_cpu, lora_add_ref  # noqa: E402

RUN_TRITON_HERE = ON_GPU or isinstance(lora_triton.lora_add_kernel, InterpretedFunction)
ROOT = Path(__file__).resolve().parents[4]


def case(
    num_tokens: int, k: int, n: int, r: int, num_slots: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """x, y, a, b, scales and slots with every slot and the base (-1) among the tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    y = torch.randn(num_tokens, n, generator=g)
    a = torch.randn(num_slots, r, k, generator=g) / k**0.5
    b = torch.randn(num_slots, n, r, generator=g)
    scales = torch.rand(num_slots, generator=g) + 0.5
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    every = torch.tensor([*range(num_slots), -1], dtype=torch.int32)[:num_tokens]
    slots[: len(every)] = every
    return x, y, a, b, scales, slots


@pytest.mark.parametrize("shape", [(9, 64, 96, 16, 4), (1, 576, 960, 48, 2), (33, 40, 24, 8, 5)])
@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
def test_c_kernel_matches_the_torch_reference(shape: tuple[int, ...]) -> None:
    x, y, a, b, scales, slots = case(*shape)
    expected = y.clone()
    lora_add_ref(expected, x, a, b, scales, slots)
    got = y.clone()
    lora_add_cpu(got, x, a, b, scales, slots)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base = slots == -1
    assert torch.equal(got[base], y[base])  # base-model rows untouched
    assert (got[~base] - y[~base]).abs().amax(-1).min() > 0.1  # every adapter row changed


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
def test_c_kernel_writes_back_a_bfloat16_output() -> None:
    x, y, a, b, scales, slots = case(7, 32, 48, 8, 3)
    y16 = y.bfloat16()
    expected = y16.clone()
    lora_add_ref(expected, x, a, b, scales, slots)
    lora_add_cpu(y16, x, a, b, scales, slots)
    torch.testing.assert_close(y16, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not RUN_TRITON_HERE, reason="triton was imported compiled: see the subprocess")
@pytest.mark.parametrize("shape", [(9, 64, 96, 16, 4), (5, 100, 70, 12, 3)])
def test_triton_kernel_matches_the_torch_reference(shape: tuple[int, ...]) -> None:
    device = "cuda" if ON_GPU else "cpu"
    x, y, a, b, scales, slots = (t.to(device) for t in case(*shape))
    expected = y.clone()
    lora_add_ref(expected, x, a, b, scales, slots)
    got = y.clone()
    lora_triton.lora_add_triton(got, x, a, b, scales, slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(RUN_TRITON_HERE, reason="the kernel runs in this process")
def test_triton_kernel_in_a_fresh_interpreter_process() -> None:
    """Triton was imported compiled before this module: rerun the file in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    argv += ["-k", "triton_kernel_matches"]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1]  # the kernel really ran there
