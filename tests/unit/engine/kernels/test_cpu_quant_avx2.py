"""cpu_quant.c's 256-bit int8 path (AVX2's vpmaddubsw, or AVX-VNNI's vpdpbusd), which the
library built for an AVX512-VNNI host never compiles: cpu_quant.c built on its own with the
kernels' flags but -march=x86-64-v3 (AVX2, FMA, F16C; no AVX-512), once more with -mavxvnni,
and for Skylake-X (AVX-512 without VNNI), each run on this host where it has those
instructions; and an x86-64-v2 build, which has no int8 path.

The int8 path is held to the float32 rounding bound against the matmul of the activations it
quantized (test_cpu_quant's reference and tolerance), and to the library built for this host:
the same integer sums and the same float steps, so the same outputs bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels, cpu_quant
from tests.unit.engine.kernels.test_cpu_quant import (
    assert_int8_rounding,
    assert_within_rounding,
    random_weight,
)

SOURCE = Path(cpu_kernels.__file__).with_name("cpu_quant.c")  # includes cpu_dtypes.h beside it
K = 256
V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}  # x86-64-v3, as /proc/cpuinfo names them
BUILDS = {  # name: the -march flags, and the /proc/cpuinfo flags the host needs to run it
    "avx2": (("-march=x86-64-v3",), V3),
    "avx-vnni": (("-march=x86-64-v3", "-mavxvnni"), V3 | {"avx_vnni"}),
    # AVX-512 without its VNNI (Skylake-X): the 512-bit float path beside the 256-bit int8 one
    "avx512-no-vnni": (("-march=skylake-avx512",), V3 | {"avx512f", "avx512bw", "avx512vl"}),
}


def _compiler() -> str | None:
    """The compiler cpu_kernels builds with, if there is one."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler)


def _host_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


pytestmark = [
    pytest.mark.skipif(_compiler() is None, reason="no C compiler on this host"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds"),
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread, kernel and torch, as test_cpu_quant (a shared host's second core is busy)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """cpu_quant.c alone, built with the kernels' flags for the ISA `request.param` names."""
    march, needs = BUILDS[request.param]
    lib = compile_alone(march, needs, tmp_path_factory.mktemp(request.param))
    assert lib.quant_int8_available() == 1
    return lib


def compile_alone(march: tuple[str, ...], needs: set[str], directory: Path) -> ctypes.CDLL:
    """cpu_quant.c built with the kernels' flags but these -march ones; skips where this host
    lacks the instructions to run it."""
    if missing := needs - _host_flags():
        pytest.skip(f"this host lacks {', '.join(sorted(missing))}")
    compiler = _compiler()
    assert compiler is not None
    flags = [f for f in cpu_kernels.FLAGS if f != "-march=native"]
    target = directory / "cpu_quant.so"
    subprocess.run(
        [compiler, *flags, *march, str(SOURCE), "-o", str(target), *cpu_kernels.LIBS],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lib = ctypes.CDLL(str(target))
    for name in ("quant_linear", "quant_linear_scratch", "quant_int8_available"):
        function = getattr(lib, name)
        function.restype, function.argtypes = cpu_kernels._SIGNATURES[name]
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, packed: cpu_quant.PackedQuant,
         bias: torch.Tensor | None, int8: bool) -> tuple[int, torch.Tensor]:  # fmt: skip
    """cpu_quant.quant_linear's call, on `lib`: its status and output."""
    m, n, k = x.shape[0], packed.out_features, packed.in_features
    out = torch.empty(m, n)
    scratch = torch.empty(lib.quant_linear_scratch(m, k, packed.group_size), dtype=torch.uint8)
    status = lib.quant_linear(
        x.data_ptr(), cpu_kernels.DTYPE_CODES[x.dtype], packed.data.data_ptr(), packed.bits,
        packed.group_size, cpu_kernels.address(bias), out.data_ptr(), m, n, k, int(int8),
        scratch.data_ptr(), 1,
    )  # fmt: skip
    return status, out


def run(lib: ctypes.CDLL, x: torch.Tensor, packed: cpu_quant.PackedQuant,
        bias: torch.Tensor | None, int8: bool) -> torch.Tensor:  # fmt: skip
    status, out = call(lib, x, packed, bias, int8)
    assert status == 0
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 128])
def test_int8_path_is_the_matmul_of_its_quantized_activations(
    build: ctypes.CDLL, bits: int, group_size: int
) -> None:
    """Rows 1 to 20 (blocks of four rows and every remainder), N within one panel or not a
    multiple of 16, bias or not, float32 and bfloat16 x."""
    torch.manual_seed(bits * 100 + group_size)
    for n in (5, 37):
        w = random_weight(bits, group_size, n=n, k=K)
        packed = cpu_quant.pack_quantized(w)
        for rows in range(1, 21):
            dtype = torch.bfloat16 if rows % 3 == 0 else torch.float32
            x = torch.randn(rows, K).to(dtype)
            x[0, :group_size] = 0  # a group of zeros: scale 0, no division by it
            bias = torch.randn(n) if rows % 2 else None
            out = run(build, x, packed, bias, int8=True)
            assert_int8_rounding(out, x, w, bias)


@pytest.mark.skipif(
    cpu_kernels.library() is None or not cpu_quant.int8_available(),
    reason="the library built for this host has no int8 path",
)
@pytest.mark.parametrize("bits", [4, 8])
def test_same_outputs_as_the_library_built_for_this_host(build: ctypes.CDLL, bits: int) -> None:
    """On an AVX512-VNNI host, the 512-bit path against the 256-bit one: bit for bit."""
    torch.manual_seed(bits)
    w = random_weight(bits, 32, n=300, k=512)
    packed = cpu_quant.pack_quantized(w)
    for rows in (1, 2, 3, 4, 5, 9, 20, 53):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 512).to(dtype)
            bias = torch.randn(300)
            expected = cpu_quant.quant_linear(x, packed, bias, int8_activations=True)
            assert torch.equal(run(build, x, packed, bias, int8=True), expected)


def test_a_group_too_small_to_scale_counts_as_zeros(build: ctypes.CDLL) -> None:
    """max|x| below 127 / FLT_MAX: 127 / max|x| is infinite, so the group is taken as zeros
    (x times infinity made int8 values of INT_MIN and sums that overflowed: a row of such
    groups came out ~1e-6, not 0), on either width."""
    torch.manual_seed(10)
    for bits in (4, 8):
        w = random_weight(bits, 32, n=37, k=K)
        packed = cpu_quant.pack_quantized(w)
        x = torch.randn(3, K)
        x[1] = torch.randn(K) * 1e-38  # subnormal or barely normal: 127 / 1e-38 > FLT_MAX
        x[2, 32:64] = torch.randn(32) * 1e-38
        out = run(build, x, packed, None, int8=True)
        zeroed = x.clone()
        zeroed[1], zeroed[2, 32:64] = 0, 0
        assert_int8_rounding(out, zeroed, w, None)
        if cpu_kernels.library() is not None and cpu_quant.int8_available():
            assert torch.equal(out, cpu_quant.quant_linear(x, packed, int8_activations=True))


def test_a_nan_activation_makes_its_rows_outputs_nan(build: ctypes.CDLL) -> None:
    """As on the float path (NaN times a weight), not the int8 of a NaN (x86's INT_MIN, which
    the two widths narrowed to different bytes); the other rows as without it."""
    torch.manual_seed(11)
    for bits in (4, 8):
        packed = cpu_quant.pack_quantized(random_weight(bits, 32, n=37, k=K))
        x = torch.randn(3, K)
        x[1, 40] = float("nan")
        out = run(build, x, packed, None, int8=True)
        assert bool(out[1].isnan().all()) and not bool(out[[0, 2]].isnan().any())
        assert torch.equal(out[[0, 2]], run(build, x[[0, 2]], packed, None, int8=True))
        if cpu_kernels.library() is not None and cpu_quant.int8_available():
            native = cpu_quant.quant_linear(x, packed, int8_activations=True)
            assert torch.equal(out.nan_to_num(), native.nan_to_num())


def test_int8_rows_do_not_depend_on_the_rows_beside_them(build: ctypes.CDLL) -> None:
    torch.manual_seed(8)
    for bits in (4, 8):
        packed = cpu_quant.pack_quantized(random_weight(bits, 32, n=37, k=K))
        x = torch.randn(23, K)
        batch = run(build, x, packed, None, int8=True)
        for row in (0, 3, 4, 22):
            assert torch.equal(run(build, x[row : row + 1], packed, None, int8=True)[0], batch[row])


@pytest.mark.parametrize("bits", [4, 8])
def test_float_path_matches_the_dequantized_matmul(build: ctypes.CDLL, bits: int) -> None:
    """The same build's float path (AVX2's FMAs), held to the float32 rounding bound."""
    torch.manual_seed(bits + 50)
    w = random_weight(bits, 32, n=37, k=K)
    packed = cpu_quant.pack_quantized(w)
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, K)
        bias = torch.randn(37)
        assert_within_rounding(run(build, x, packed, bias, int8=False), x, w, bias)


def test_a_build_without_avx2_has_no_int8_path(tmp_path: Path) -> None:
    """x86-64-v2 (SSE4.2): int8 refused (-1, which cpu_quant.quant_linear raises on), the float
    path on SSE within rounding."""
    lib = compile_alone(("-march=x86-64-v2",), {"sse4_2", "popcnt"}, tmp_path)
    assert lib.quant_int8_available() == 0
    torch.manual_seed(9)
    w = random_weight(4, 32, n=37, k=K)
    packed = cpu_quant.pack_quantized(w)
    x = torch.randn(3, K)
    assert call(lib, x, packed, None, int8=True)[0] == -1
    assert_within_rounding(run(lib, x, packed, None, int8=False), x, w, None)
