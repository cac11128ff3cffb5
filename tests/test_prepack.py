"""oneDNN prepacked Linear (target/prepack.py): same numbers as F.linear, only where it applies, model otherwise untouched."""

import pytest
import torch
from torch import nn

from eagle3.target.prepack import prepack_available, prepack_linears

pytestmark = pytest.mark.skipif(not prepack_available(), reason="PyTorch built without oneDNN")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.SiLU(), nn.Linear(96, 80, bias=True)).to(dtype)


@pytest.mark.parametrize("single_row", ["auto", "packed", "plain"])
@pytest.mark.parametrize("rows", [1, 2, 6, 37])
def test_prepacked_linears_match_float64(rows, single_row):
    m = _model()
    ref = _model(torch.float64)  # same seed: same weights, in float64
    x = torch.randn(1 if rows == 1 else 2, rows, 64)  # [1, 1, 64]: one row, the one-row path
    assert prepack_linears(m, rows_hint=6, single_row=single_row) == 2
    assert all(hasattr(l, "_packed_weight") for l in (m[0], m[2]))
    if single_row != "auto":
        assert all(l._plain_single_row is (single_row == "plain") for l in (m[0], m[2]))
    with torch.no_grad():
        got, want = m(x), ref(x.double())
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], rows, 80)
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


def _count_paths(monkeypatch, calls: list) -> None:
    """Wrap the two matmul paths of eagle3.target.prepack so that each call appends 'plain' or 'packed' to calls."""
    import eagle3.target.prepack as P
    real_linear, real_packed = torch.nn.functional.linear, P._packed_matmul

    class Fwrap:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(*a, **k):
            calls.append("plain")
            return real_linear(*a, **k)

    monkeypatch.setattr(P, "F", Fwrap())
    monkeypatch.setattr(P, "_packed_matmul", lambda *a: (calls.append("packed"), real_packed(*a))[1])


def test_one_row_calls_take_the_path_chosen_for_them(monkeypatch):
    """single_row="plain": a one-row call runs F.linear and a multi-row call the packed op; "packed": both packed.
    Counted by wrapping the two ops, so a dispatch that ignored the choice fails here."""
    calls = []
    for mode, want in [("plain", ["plain", "packed"]), ("packed", ["packed", "packed"])]:
        m = nn.Linear(64, 96)
        prepack_linears(m, single_row=mode, check=False)
        _count_paths(monkeypatch, calls)
        calls.clear()
        with torch.no_grad():
            m(torch.randn(1, 64))
            m(torch.randn(6, 64))
        monkeypatch.undo()
        assert calls == want, mode
    with pytest.raises(ValueError, match="single_row"):
        prepack_linears(nn.Linear(4, 4), single_row="fast")


def test_auto_times_every_row_count_and_each_call_takes_its_faster_path(monkeypatch):
    """single_row="auto": each row count 1..rows_hint is timed (here: a stand-in timing saying plain wins at 1 and
    2 rows only) and a call of that many rows takes the path chosen for it; the results stay F.linear's."""
    import eagle3.target.prepack as P
    timed = []
    monkeypatch.setattr(P, "_plain_is_faster", lambda w, packed, rows: (timed.append(rows), rows <= 2)[1])
    m = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    assert prepack_linears(m, rows_hint=4, single_row="auto", check=False) == 2
    assert timed == [1, 2, 3, 4, 1, 2, 3, 4]  # per weight shape, every row count once
    assert m[0]._plain_rows == frozenset({1, 2}) and m[0]._plain_single_row
    monkeypatch.undo()
    calls = []
    _count_paths(monkeypatch, calls)
    lin = m[0]
    with torch.no_grad():
        for rows in (1, 2, 3, 6):
            x = torch.randn(rows, 64, dtype=torch.float32)
            got = lin(x)
            want = x.double() @ lin.weight.double().T + lin.bias.double()
            assert torch.allclose(got.double(), want, atol=1e-4)
    assert calls == ["plain", "plain", "packed", "packed"]


def test_the_one_row_path_is_settled_by_the_whole_step(monkeypatch):
    """choose_one_row_path times the model's own one-row step under the per-shape choices, all plain and all packed,
    interleaved, on a scripted clock (a step costs 5 s per Linear running one row plain, 3 s per packed one, and
    the 2nd repeat of 'packed' is slow): it keeps all packed (the median's, not the slow run's), leaves the
    multi-row choices as they were, and the calls then take that path."""
    import eagle3.target.prepack as P
    monkeypatch.setattr(P, "_plain_is_faster", lambda w, packed, rows: rows <= 2)  # per shape: plain at 1, 2 rows
    m = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    prepack_linears(m, rows_hint=4, single_row="auto", check=False)
    clock, order, spell = [0.0], [], iter([0.0, 0.0, 100.0, 0.0])  # packed: warm-up, repeats 1-3
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])

    def step():
        plain = sum(lin._plain_single_row for lin in m)
        order.append(plain)
        clock[0] += 5.0 * plain + 3.0 * (len(m) - plain) + (next(spell) if plain == 0 else 0.0)
    got = P.choose_one_row_path(m, step, repeats=3)
    assert got["chosen"] == "packed" and got["one_row_plain"] == 0
    assert got["median_s"] == {"per_shape": 10.0, "plain": 10.0, "packed": 6.0}
    assert order == [2, 2, 0] * 4                     # warm-up, then 3 repeats, each path once per repeat
    assert all(lin._plain_rows == frozenset({2}) and not lin._plain_single_row for lin in m)
    monkeypatch.undo()
    calls = []
    _count_paths(monkeypatch, calls)
    with torch.no_grad():
        for rows in (1, 2, 3):
            x = torch.randn(rows, 64)
            assert torch.allclose(m[0](x).double(), x.double() @ m[0].weight.double().T + m[0].bias.double(),
                                  atol=1e-4)
    assert calls == ["packed", "plain", "packed"]
    assert P.choose_one_row_path(nn.Linear(4, 4), lambda: None)["chosen"] is None   # nothing packed: nothing to do
