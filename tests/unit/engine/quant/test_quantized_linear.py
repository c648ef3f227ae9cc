"""A linear layer that takes a quantized matrix computes the dequantized one's product, on the
C kernel where it built, else as the float matrix; fused projections concatenate their rows."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_quant
from engine.linear import Linear
from engine.quant.weight import QuantizedWeight, concat_rows


def random_q4(n: int, k: int, group: int = 32) -> QuantizedWeight:
    g = torch.Generator().manual_seed(n * 1000 + k)
    return QuantizedWeight(
        bits=4, group_size=group,
        values=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        scales=(torch.rand(n, k // group, generator=g) * 0.02).half().float(),
        mins=(-torch.rand(n, k // group, generator=g) * 0.1).half().float(),
    )  # fmt: skip


@pytest.mark.parametrize("layout", ["panels", "plain"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_layer_computes_its_dequantized_matrix(
    layout: str, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = random_q4(40, 64)
    with torch.device("meta"):
        layer = Linear(64, 40, bias=bias)
    layer.quantize(weight, torch.float32)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(40), requires_grad=False)
    layer.pack(layout)  # type: ignore[arg-type]
    x = torch.randn(16, 64)
    expected = torch.nn.functional.linear(x, weight.dequantize(), layer.bias)
    # int8 activations (the default where the kernels have AVX512-VNNI): their rounding
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0.02 * float(expected.abs().max()))
    monkeypatch.setattr(cpu_quant, "INT8_MIN_ROWS", 1 << 30)  # float activations: exact
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert not hasattr(layer, "q_values")  # the unpacked copy is gone once packed


def test_rows_concatenate_and_a_mixed_fusion_is_refused() -> None:
    q, k = random_q4(8, 64), random_q4(4, 64)
    fused = concat_rows([q, k])
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    with pytest.raises(ValueError, match="quantized differently"):
        concat_rows([q, random_q4(4, 64, group=16)])
    with pytest.raises(ValueError, match=r"a \(8, 64\) matrix"):
        Linear(32, 8).quantize(q, torch.float32)
