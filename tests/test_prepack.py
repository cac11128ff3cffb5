"""oneDNN prepacked Linear (target/prepack.py): same numbers as F.linear, only where it applies, model otherwise untouched."""

import pytest
import torch
from torch import nn

from eagle3.target.prepack import prepack_available, prepack_linears

pytestmark = pytest.mark.skipif(not prepack_available(), reason="PyTorch built without oneDNN")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.SiLU(), nn.Linear(96, 80, bias=True)).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 6, 37])
def test_prepacked_linears_match_float64(rows):
    m = _model()
    ref = _model(torch.float64)  # same seed: same weights, in float64
    x = torch.randn(2, rows, 64)
    assert prepack_linears(m, rows_hint=6) == 2
    assert all(hasattr(l, "_packed_weight") for l in (m[0], m[2]))
    with torch.no_grad():
        got, want = m(x), ref(x.double())
    assert got.dtype == torch.float32 and got.shape == (2, rows, 80)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_prepack_leaves_weights_state_dict_and_other_dtypes_alone():
    m = _model()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    prepack_linears(m)
    assert m.state_dict().keys() == sd.keys() and all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    assert prepack_linears(m) == 0                       # already packed: nothing more to do
    assert prepack_linears(_model(torch.float64)) == 0   # float64 (and bf16) stay on F.linear
    assert prepack_linears(_model(torch.bfloat16)) == 0


def test_prepacked_linear_still_trains_through_f_linear():
    m = _model()
    prepack_linears(m)
    x = torch.randn(4, 64)
    m(x).sum().backward()  # the packed op has no autograd: a grad-enabled call must take F.linear
    assert m[0].weight.grad is not None and m[2].weight.grad is not None
