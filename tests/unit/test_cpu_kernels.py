"""The C kernels of the CPU path (engine/kernels/cpu_paged.c) against the torch reference, the
dispatch that picks them, and the fallback when they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import attention
from engine.kernels import cpu_paged, torch_paged
from engine.kernels.reference import paged_decode_attention_ref, store_kv_ref

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}  # as test_kernels.py

pytestmark = pytest.mark.skipif(cpu_paged.library() is None, reason="no C compiler on this host")


class PagedCache:
    """K/V views of layer 1 of a block-major pool, as the engine's, with shuffled block tables."""

    def __init__(self, lens: list[int], kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        blocks_per_seq = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks_per_seq) + 3
        self.pool = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim).to(dtype)
        self.k, self.v = self.pool[:, 1, 0], self.pool[:, 1, 1]
        order, tables, width = torch.randperm(num_blocks).tolist(), [], max(blocks_per_seq)
        for n in blocks_per_seq:
            row, order = order[:n], order[n:]
            tables.append(row + [0] * (width - n))
        self.block_tables = torch.tensor(tables, dtype=torch.int32)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


SHAPES = [  # (dtype, num_heads, num_kv_heads, head_dim, block_size): specialised and generic d
    (torch.float32, 9, 3, 64, 16),
    (torch.float32, 8, 2, 128, 32),
    (torch.float32, 4, 4, 80, 16),
    (torch.bfloat16, 8, 2, 64, 16),
    (torch.bfloat16, 16, 2, 128, 32),
]


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(1)
    lens = [150, 1, 37, 90, 16]  # unsorted, one token, block-size multiples and not
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype)
    q = (4 * torch.randn(len(lens), num_heads, head_dim)).to(dtype)  # large: the cap matters
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (20, None), (None, 3.0), (33, 5.0)]:
        expected = paged_decode_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(cpu_paged.paged_decode_attention(*args, window, cap), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_threads_matches_one_thread(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    cache = PagedCache([70, 5, 130, 33], 2, 64, 16, dtype)
    q = torch.randn(4, 8, 64).to(dtype)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_paged.paged_decode_attention(*args)
        torch.set_num_threads(2)
        assert torch.equal(cpu_paged.paged_decode_attention(*args), one)  # same sums per row
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_of_the_pool_view(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    cache = PagedCache([40], 2, 64, 16, dtype)
    slots = torch.tensor([3, 17, 33, -1, 47])  # -1: a padding token, not written
    k, v = torch.randn(5, 2, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    expected = cache.pool.clone()
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    cpu_paged.store_kv(k, v, cache.k, cache.v, slots)
    assert torch.equal(cache.pool, expected)  # other layers and the padding slot untouched


def test_auto_takes_the_c_kernels_on_cpu_and_the_torch_path_where_they_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch path ran")

    torch.manual_seed(4)
    cache = PagedCache([30, 7], 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    with monkeypatch.context() as patch:
        patch.setattr(torch_paged, "paged_decode_attention", fail)
        assert_close(attention.decode_attention(*args), paged_decode_attention_ref(*args))
    half = PagedCache([30, 7], 2, 64, 16, torch.float16)  # a type the C kernels do not read
    half_args = (q.half(), half.k, half.v, half.block_tables, half.context_lens, 0.125)
    out = attention.decode_attention(*half_args)
    torch.testing.assert_close(out, paged_decode_attention_ref(*half_args), atol=4e-3, rtol=4e-3)
    with pytest.raises(RuntimeError, match="'cpu' needs a float32 or bfloat16"):
        attention.decode_attention(*half_args, backend="cpu")


def test_without_a_compiler_the_engine_takes_the_torch_path(tmp_path: Path) -> None:
    """No compiler (and an empty kernel cache): a warning, then the same outputs from torch."""
    script = (
        "import torch, logging; logging.basicConfig();"
        "from engine.kernels import cpu_paged; from engine import attention;"
        "assert cpu_paged.library() is None;"
        "from engine.llm import LLM; from common.sampling_params import SamplingParams;"
        "out = LLM('builtin:tiny').generate(['a b c'], SamplingParams(max_tokens=4, ignore_eos=True));"
        "print(len(out[0].outputs[0].token_ids))"
    )
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    cache = Path("~/.cache/pdcluster").expanduser()
    for name in cache.glob("tiny-model-*"):  # the tiny model, without building it again
        (home / ".cache/pdcluster").mkdir(exist_ok=True)
        (home / ".cache/pdcluster" / name.name).symlink_to(name)
    env = {**os.environ, "HOME": str(home), "CC": str(tmp_path / "no-such-compiler")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "4"
    assert "CPU attention kernel unavailable, using the torch path" in done.stderr
