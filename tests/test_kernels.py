"""The CPU fast paths of `Linear` (native skinny kernel, oneDNN prepack) equal F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.layers import SKINNY_MAX_ROWS, Linear

native = kernels.skinny_linear()


@pytest.mark.skipif(native is None, reason="no AVX-512 bf16 CPU or no compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (2, 64, 8), (3, 100, 13), (4, 1536, 37), (1, 7, 1)])
def test_native_skinny_linear_matches_reference(dtype, tol, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    for bias in (None, b):
        got = native(x, w, bias).double()
        want = ref if bias is not None else ref - b.double()
        assert got.shape == (m, n) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 33])
def test_prepacked_linear_matches_f_linear(dtype, rows):
    lin = Linear(96, 200, bias=True)
    gen = torch.Generator().manual_seed(rows)
    lin.weight.data = (torch.randn(200, 96, generator=gen) / 10).to(dtype)
    lin.bias.data = torch.randn(200, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert lin.prepack()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol)
