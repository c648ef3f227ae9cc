"""cpu_quant.c's quantized matmul against QuantizedWeight.dequantize() and torch's matmul.

Tolerances are float32 rounding bounds, not guesses. A float32 sum of K products is within
K * 2^-24 of the sum of their magnitudes of the exact sum (Higham's gamma_K); the kernel sums
scale * x * q and min * x apart (as the dequantized weight's scale * q + min holds them), so its
magnitudes are |x| @ (|scale| |q| + |min|).T, and torch's own sum has as much again: the float
path may differ from the reference by 2 (K + 4) 2^-24 times those magnitudes (4: the scaling,
the group's sums, the bias). bfloat16 x is read exactly (the reference widens the same values).
The int8 path is held to the same bound against the activations it quantized (emulated here,
rounding as the kernel does), and to half a quantization step an element against the exact
product.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels import cpu_kernels, cpu_quant
from engine.quant.weight import QuantizedWeight

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this host")
needs_int8 = pytest.mark.skipif(
    cpu_kernels.library() is None or not cpu_quant.int8_available(),
    reason="the kernels have no AVX512-VNNI here",
)
N, K = 37, 256  # N: two full panels and a partial one


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread (kernel and torch) unless a test asks for more: on a host whose cores other
    jobs share, a team of two waits on the busy one (1.7 s for this file against 9-25 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_weight(bits: int, group_size: int, n: int = N, k: int = K) -> QuantizedWeight:
    """Random values; scales of both signs (Q6_K's are) and mins, all exact in float16."""
    groups = (n, k // group_size)
    scales = (torch.randn(groups) * 0.02).half().float()
    if bits == 8:
        return QuantizedWeight(8, group_size, torch.randint(-128, 128, (n, k), dtype=torch.int8),
                               scales, None)  # fmt: skip
    mins = (-8 * scales + torch.randn(groups) * 0.01).half().float()
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return QuantizedWeight(4, group_size, values, scales, mins)


def magnitudes(w: QuantizedWeight) -> torch.Tensor:
    """(N, K): |scale| |q| + |min| per weight, what the kernel's sums add up."""
    n, k = w.shape
    parts = w.values.float().abs().reshape(n, -1, w.group_size) * w.scales.abs().unsqueeze(-1)
    if w.mins is not None:
        parts = parts + w.mins.abs().unsqueeze(-1)
    return parts.reshape(n, k)


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight,
                           bias: torch.Tensor | None,
                           x_size: torch.Tensor | None = None) -> None:  # fmt: skip
    """out is x @ W.T + bias to float32 rounding; x_size: the sizes of the parts the kernel
    summed x from, where more than |x| (the int8 path's two planes)."""
    x = x.float()
    expected = x @ w.dequantize().T + (0 if bias is None else bias)
    size = x.abs() if x_size is None else x_size
    bound = size @ magnitudes(w).T + (0 if bias is None else bias.abs())
    tolerance = 2 * (w.shape[1] + 4) * 2.0**-24 * bound
    assert out.shape == expected.shape and out.dtype == torch.float32
    excess = (out - expected).abs() - tolerance
    assert float(excess.max()) <= 0, f"off by {float((out - expected).abs().max()):.3g}"


def quantized_activations(x: torch.Tensor, group_size: int, planes: int) -> list[torch.Tensor]:
    """x as the int8 path sees it, one tensor a plane: per row and group, q = round(x * (127 /
    max|x|)) (a true division for 127 / max|x|, as the C computes it) times d = max|x| / 127;
    with two planes (8-bit weights), also round(254 (x * (127 / max|x|) - q)) times d / 254."""
    rows, k = x.shape
    grouped = x.float().reshape(rows, k // group_size, group_size)
    amax = grouped.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    scaled = grouped * inv
    step = amax / 127.0
    parts = [torch.round(scaled) * step]
    if planes == 2:
        parts.append(torch.round((scaled - torch.round(scaled)) * 254.0) * (step / 254.0))
    return [part.reshape(rows, k) for part in parts]


def assert_int8_rounding(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight,
                         bias: torch.Tensor | None) -> None:  # fmt: skip
    """out is the matmul of the activations the int8 path quantized (two planes for 8-bit
    weights) to float32 rounding."""
    parts = quantized_activations(x, w.group_size, planes=2 if w.bits == 8 else 1)
    size = sum(part.abs() for part in parts)
    assert_within_rounding(out, sum(parts), w, bias, x_size=size)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_path_matches_the_dequantized_matmul(
    bits: int, group_size: int, dtype: torch.dtype
) -> None:
    """Every row-count shape the kernel unrolls apart (1, 2: split accumulators; 3; 8: a full
    block; 33: blocks and a remainder; 57: a second block of 48 rows), N not a multiple of its
    16-column panels, a bias or not, group sizes down to 16 and up to the whole row (int8 per
    channel)."""
    torch.manual_seed(bits * 1000 + group_size)
    w = random_weight(bits, group_size)
    packed = cpu_quant.pack_quantized(w)
    for rows in (1, 2, 3, 8, 33, 57):
        x = torch.randn(rows, K).to(dtype)
        for bias in (None, torch.randn(N)):
            out = cpu_quant.quant_linear(x, packed, bias, int8_activations=False)
            assert_within_rounding(out, x, w, bias)


@needs_int8
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_path_is_the_matmul_of_its_quantized_activations(
    bits: int, group_size: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(bits * 1000 + group_size + 1)
    w = random_weight(bits, group_size)
    packed = cpu_quant.pack_quantized(w)
    for rows in (1, 2, 3, 8, 9, 33, 57):
        x = torch.randn(rows, K).to(dtype)
        x[0, :group_size] = 0  # a group of zeros: scale 0, no division by it
        bias = torch.randn(N)
        out = cpu_quant.quant_linear(x, packed, bias, int8_activations=True)
        assert_int8_rounding(out, x, w, bias)
        # against the exact product: each activation is off by at most half a step (8 bits:
        # of the second plane's step, 254 times finer than one plane's)
        step = x.float().reshape(rows, -1, group_size).abs().amax(-1) / 127  # (rows, groups)
        if bits == 8:
            step = step / 254
        weight = w.dequantize()
        per_group = weight.abs().reshape(N, -1, group_size).sum(-1)  # (N, groups)
        exact = x.float() @ weight.T + bias
        bound = (step / 2) @ per_group.T + 1e-4 * (x.float().abs() @ weight.abs().T)
        assert bool(((out - exact).abs() <= bound).all())


def test_default_path_by_row_count() -> None:
    """None takes the int8 path from INT8_MIN_ROWS rows where the kernels have it, else the
    float path (bit for bit the same as asking for it)."""
    torch.manual_seed(3)
    packed = cpu_quant.pack_quantized(random_weight(4, 32))
    for rows in (1, 2, 8, 32):
        x = torch.randn(rows, K)
        int8 = rows >= cpu_quant.INT8_MIN_ROWS and cpu_quant.int8_available()
        expected = cpu_quant.quant_linear(x, packed, int8_activations=int8)
        assert torch.equal(cpu_quant.quant_linear(x, packed), expected)


@needs_int8
def test_int8_rows_do_not_depend_on_the_rows_beside_them() -> None:
    """A row's int8-path result is the same alone or in any batch (integer sums, the same float
    steps per row): a sequence decodes the same whatever else is in the step."""
    torch.manual_seed(8)
    for bits in (4, 8):
        packed = cpu_quant.pack_quantized(random_weight(bits, 32))
        x = torch.randn(33, K)
        batch = cpu_quant.quant_linear(x, packed, int8_activations=True)
        for row in (0, 7, 8, 32):
            alone = cpu_quant.quant_linear(x[row : row + 1], packed, int8_activations=True)
            assert torch.equal(alone[0], batch[row])


def test_threads_split_panels_without_changing_results() -> None:
    torch.manual_seed(4)
    w = random_weight(8, 32, n=300, k=512)
    packed = cpu_quant.pack_quantized(w)
    x = torch.randn(5, 512)
    one = [cpu_quant.quant_linear(x, packed, int8_activations=False)]
    if cpu_quant.int8_available():
        one.append(cpu_quant.quant_linear(x, packed, int8_activations=True))
    torch.set_num_threads(2)  # the fixture restores it
    two = [cpu_quant.quant_linear(x, packed, int8_activations=False)]
    if cpu_quant.int8_available():
        two.append(cpu_quant.quant_linear(x, packed, int8_activations=True))
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_packed_bytes_per_weight_are_ggufs() -> None:
    """4 bits in groups of 32: 5 bits a weight (Q4_1); 8 bits: 8.5 (Q8_0); N padded to 16."""
    for bits, group_size, per_weight in ((4, 32, 5.0), (8, 32, 8.5), (4, 128, 4.25)):
        packed = cpu_quant.pack_quantized(random_weight(bits, group_size, n=64, k=K))
        assert packed.nbytes * 8 / (64 * K) == per_weight
    padded = cpu_quant.pack_quantized(random_weight(4, 32))  # N = 37: three panels
    assert padded.data.shape == (3, K // 32, cpu_quant.block_bytes(4, 32))


def test_scales_and_mins_are_rounded_to_float16_when_packed() -> None:
    """A K-quant's d * sc need not be a float16: the kernel multiplies by its float16 rounding
    (within 2^-11 of it), as if the loader had handed that over."""
    torch.manual_seed(5)
    w = random_weight(4, 32)
    rough = QuantizedWeight(4, 32, w.values, w.scales * 1.0001, w.mins * 0.9999)
    rounded = QuantizedWeight(4, 32, w.values, rough.scales.half().float(),
                              rough.mins.half().float())  # fmt: skip
    assert not torch.equal(rough.scales, rounded.scales)
    assert bool(((rounded.scales - rough.scales).abs() <= 2.0**-11 * rough.scales.abs()).all())
    x = torch.randn(4, K)
    out = cpu_quant.quant_linear(x, cpu_quant.pack_quantized(rough), int8_activations=False)
    assert_within_rounding(out, x, rounded, None)


def test_leading_dimensions_and_no_rows() -> None:
    torch.manual_seed(6)
    w = random_weight(8, 64)
    packed = cpu_quant.pack_quantized(w)
    x = torch.randn(2, 3, K)
    out = cpu_quant.quant_linear(x, packed)
    assert out.shape == (2, 3, N)
    assert torch.equal(out.reshape(6, N), cpu_quant.quant_linear(x.reshape(6, K), packed))
    assert cpu_quant.quant_linear(torch.empty(0, K), packed).shape == (0, N)


def test_what_it_cannot_take_is_refused() -> None:
    w = random_weight(4, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_quant.pack_quantized(QuantizedWeight(4, 8, w.values, torch.ones(N, K // 8),
                                                 torch.zeros(N, K // 8)))  # fmt: skip
    with pytest.raises(ValueError, match="0..15"):
        cpu_quant.pack_quantized(QuantizedWeight(4, 32, w.values + 16, w.scales, w.mins))
    with pytest.raises(ValueError, match="float16"):
        cpu_quant.pack_quantized(QuantizedWeight(4, 32, w.values, w.scales * 1e7, w.mins))
    packed = cpu_quant.pack_quantized(w)
    with pytest.raises(ValueError, match="features"):
        cpu_quant.quant_linear(torch.randn(1, K + 1), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_quant.quant_linear(torch.randn(1, K), packed, torch.randn(N + 1))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stream_read_reads_every_byte(prefetch: int) -> None:
    """bench/peers.py's bandwidth bound times stream_read, both ways: it must read all n bytes
    (its checksum is the sum of the buffer as int64 words)."""
    lib = cpu_kernels.library()
    assert lib is not None
    words = torch.arange(1 << 16, dtype=torch.int64)  # 512 KB: past the prefetch distance
    assert lib.stream_read(words.data_ptr(), words.numel() * 8, prefetch) == int(words.sum())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_few_rows_prefetch_changes_no_result(bits: int, rows: int) -> None:
    """Prefetching or not at one or two rows (the engine's pick at load, cpu_prefetch.h) moves no
    bit: the same results either way (three rows always prefetch); the default set back."""
    lib = cpu_kernels.library()
    assert lib is not None
    w = random_weight(bits, 32)
    packed = cpu_quant.pack_quantized(w)
    x = torch.randn(rows, K)
    try:
        outs = []
        for on in (0, 1):
            lib.set_few_rows_prefetch(on)
            outs += [cpu_quant.quant_linear(x, packed, int8_activations=False)]
            if cpu_quant.int8_available():
                outs += [cpu_quant.quant_linear(x, packed, int8_activations=True)]
    finally:
        lib.set_few_rows_prefetch(1)
    half = len(outs) // 2
    for off, on in zip(outs[:half], outs[half:], strict=True):
        assert torch.equal(off, on)
