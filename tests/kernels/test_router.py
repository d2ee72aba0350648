"""Routers: kernels vs references vs HF transformers' own router modules; batch invariance."""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.backend import default_device
from ds4t.kernels.router import (
    DROPPED_SCORE,
    _take_max,
    router_sigmoid_grouped,
    router_sigmoid_grouped_ref,
    router_softmax_topk,
    router_softmax_topk_ref,
)
from tests.kernels.devices import gen
from tests.kernels.invariance import assert_rows_invariant

pytestmark = pytest.mark.usefixtures("on_kernel_device")

WTOL = dict(rtol=2e-6, atol=2e-7)  # weights are fp32 statistics


def _poisoned_out(B, k):
    return torch.full((B, k), float("nan")), torch.full((B, k), -12345, dtype=torch.int32)


def _sort_by_id(w, ids):
    order = torch.argsort(ids.long(), dim=-1)
    return w.gather(1, order), ids.long().gather(1, order)


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("B,E,k", [(5, 8, 2), (13, 10, 3), (17, 64, 8), (1, 3, 3)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_vs_ref(B, E, k, renorm):
    g = gen(B * 100 + E)
    x = torch.randn(B, E, generator=g) * 3
    out = _poisoned_out(B, k)
    w, ids = router_softmax_topk(x, k, renorm, out=out)
    assert w is out[0] and ids is out[1]
    wr, ir = router_softmax_topk_ref(x, k, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, **WTOL)
    assert bool((w[:, :-1] >= w[:, 1:]).all())  # descending rank order
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(B), rtol=0, atol=1e-6)


@pytest.mark.parametrize("B,E,k", [(5, 8, 2), (13, 10, 3), (3, 9, 9)])
def test_softmax_topk_one_row_programs(B, E, k):
    """The GPU's one row per program (in the interpreter too) gives the bits of the interpreter's
    16-row programs, with E a power of two and not (padded expert columns)."""
    from ds4t.kernels import router as RT

    g = gen(B + E)
    x = torch.randn(B, E, generator=g) * 3
    many = router_softmax_topk(x, k, True)
    with RT.ROUTER_CONFIGS.forced(lambda E: RT.RouterConfig(rows=1)):
        one = router_softmax_topk(x, k, True)
    assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])
    wr, ir = router_softmax_topk_ref(x, k, True)
    assert torch.equal(one[1], ir)
    torch.testing.assert_close(one[0], wr, **WTOL)


def test_softmax_topk_ties_go_to_lower_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0], [0.5] * 6])
    _, ids = router_softmax_topk(x, 3, False)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]


def test_softmax_topk_bf16_logits_are_upcast():
    g = gen(3)
    x = (torch.randn(4, 10, generator=g) * 2).bfloat16()
    w, ids = router_softmax_topk(x, 3, True)
    wr, ir = router_softmax_topk_ref(x.float(), 3, True)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, **WTOL)


def test_softmax_topk_vs_hf_qwen3_next():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    g = gen(0)
    for E, k, norm in ((8, 2, True), (10, 3, False), (32, 4, True)):
        cfg = Qwen3NextConfig(hidden_size=64, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
        router = Qwen3NextTopKRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, 64, generator=g) * 0.3)
        hid = torch.randn(11, 64, generator=g)
        with torch.no_grad():
            logits, hw, hi = router(hid)
            w, ids = router_softmax_topk(F.linear(hid, router.weight), k, norm)
        assert torch.equal(ids.long(), hi)
        torch.testing.assert_close(w, hw, **WTOL)


# ----------------------------------------------------------------------------- sigmoid grouped

GROUPED = [
    # B, E, k, n_group, topk_group, renorm, scaling
    (5, 8, 2, 2, 1, True, 2.5),     # tiny DeepSeek-V3
    (7, 8, 2, 1, 1, True, 1.0),     # tiny GLM-4.5 (one group)
    (9, 10, 3, 2, 1, False, 1.5),
    (6, 16, 4, 4, 2, True, 2.5),
    (3, 64, 8, 8, 4, True, 2.5),    # DeepSeek-V3 proportions
    (4, 12, 3, 6, 3, True, 1.0),    # groups of 2
]


@pytest.mark.parametrize("B,E,k,ng,tg,renorm,scaling", GROUPED)
def test_sigmoid_grouped_vs_ref(B, E, k, ng, tg, renorm, scaling):
    g = gen(E * 10 + k)
    x = torch.randn(B, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3
    out = _poisoned_out(B, k)
    w, ids = router_sigmoid_grouped(x, bias, k, ng, tg, renorm, scaling, out=out)
    assert w is out[0] and ids is out[1]
    wr, ir = router_sigmoid_grouped_ref(x, bias, k, ng, tg, renorm, scaling)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, **WTOL)
    # ids come from the kept groups only and are distinct
    assert all(len(set(r)) == k for r in ids.tolist())
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.full((B,), scaling), rtol=1e-6, atol=1e-6)


def _hf_router(kind, E, k, ng, tg, renorm, scaling, g):
    if kind == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as R,
        )

        cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=E, num_experts_per_tok=k, n_group=ng,
                               topk_group=tg, norm_topk_prob=renorm, routed_scaling_factor=scaling)
    else:
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import (
            Glm4MoeTopkRouter as R,
        )

        cfg = Glm4MoeConfig(hidden_size=64, n_routed_experts=E, num_experts_per_tok=k, n_group=ng,
                            topk_group=tg, norm_topk_prob=renorm, routed_scaling_factor=scaling)
    router = R(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, 64, generator=g) * 0.3)
        # HF's buffer starts at zero: make the bias path matter
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.5)
    return router


@pytest.mark.parametrize("kind,E,k,ng,tg,renorm,scaling", [
    ("deepseek_v3", 8, 2, 2, 1, True, 2.5),
    ("deepseek_v3", 16, 4, 4, 2, True, 2.5),
    ("deepseek_v3", 10, 3, 2, 1, False, 1.5),
    ("glm4_moe", 8, 2, 1, 1, True, 1.0),
    ("glm4_moe", 12, 3, 3, 2, True, 1.8),
])
def test_sigmoid_grouped_vs_hf(kind, E, k, ng, tg, renorm, scaling):
    g = gen(7)
    router = _hf_router(kind, E, k, ng, tg, renorm, scaling, g)
    hid = torch.randn(13, 64, generator=g)
    with torch.no_grad():
        _, hw, hi = router(hid)
        logits = F.linear(hid, router.weight)
        w, ids = router_sigmoid_grouped(logits, router.e_score_correction_bias, k, ng, tg, renorm, scaling)
    # HF picks with topk(sorted=False): compare as sets (ordered by expert id)
    hw, hi = _sort_by_id(hw, hi)
    w, ids = _sort_by_id(w, ids)
    assert torch.equal(ids, hi)
    torch.testing.assert_close(w, hw, **WTOL)


def _negative_bias_case():
    # All biased scores negative (bias -2): a dropped expert filled with 0.0 would beat every kept one.
    g = gen(1)
    x = torch.randn(6, 8, generator=g)
    x[:, :4] += 2.0  # group 0 wins the group vote
    bias = torch.full((8,), -2.0) + torch.randn(8, generator=g) * 0.1
    return x, bias


def test_dropped_group_fill_matches_hf_and_matters():
    """HF's fill for dropped groups (0.0 in transformers 4.x, -inf in 5.x) changes the choice here;
    the default must agree with the installed HF, and both fills must be implemented correctly."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    x, bias = _negative_bias_case()
    E, k, ng, tg = 8, 2, 2, 1
    # the two fills choose differently on this input (else the test proves nothing)
    _, i_inf = router_sigmoid_grouped_ref(x, bias, k, ng, tg, True, 2.5, dropped=float("-inf"))
    _, i_zero = router_sigmoid_grouped_ref(x, bias, k, ng, tg, True, 2.5, dropped=0.0)
    assert not torch.equal(i_inf, i_zero)
    for fill in (float("-inf"), 0.0):
        w, ids = router_sigmoid_grouped(x, bias, k, ng, tg, True, 2.5, dropped=fill)
        wr, ir = router_sigmoid_grouped_ref(x, bias, k, ng, tg, True, 2.5, dropped=fill)
        assert torch.equal(ids, ir)
        torch.testing.assert_close(w, wr, **WTOL)

    # HF, driven through its real router with these exact logits (identity weight)
    cfg = DeepseekV3Config(hidden_size=8, n_routed_experts=E, num_experts_per_tok=k, n_group=ng,
                           topk_group=tg, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        router.e_score_correction_bias.copy_(bias)
        _, hw, hi = router(x)
    w, ids = router_sigmoid_grouped(x, bias, k, ng, tg, True, 2.5)  # default fill
    hw, hi = _sort_by_id(hw, hi)
    w, ids = _sort_by_id(w, ids)
    assert torch.equal(ids, hi), f"default fill {DROPPED_SCORE} disagrees with installed HF"
    torch.testing.assert_close(w, hw, **WTOL)


# ----------------------------------------------------------------------------- batch invariance

POOL = 33


def _pool(E, seed):
    g = gen(seed)
    return torch.randn(POOL, E, generator=g) * 2, torch.randn(E, generator=g) * 0.3


with torch.device(default_device()):
    _SM_X, _ = _pool(10, 11)
    _SG_X, _SG_BIAS = _pool(16, 12)


def _rows():
    # a random order of a random-size subset of the pool, and one position in it
    return st.tuples(st.permutations(range(POOL)), st.integers(1, POOL)).map(lambda t: t[0][: t[1]]).flatmap(
        lambda rows: st.tuples(st.just(rows), st.integers(0, len(rows) - 1)))


@settings(max_examples=12, deadline=None)
@given(_rows())
def test_softmax_topk_rows_invariant(case):
    rows, i = case

    def run(rs):
        w, ids = router_softmax_topk(_SM_X[rs], 3, True)
        return torch.cat([w, ids.float()], dim=1)

    assert_rows_invariant(run, rows, i)


@settings(max_examples=12, deadline=None)
@given(_rows())
def test_sigmoid_grouped_rows_invariant(case):
    rows, i = case

    def run(rs):
        w, ids = router_sigmoid_grouped(_SG_X[rs], _SG_BIAS, 4, 4, 2, True, 2.5)
        return torch.cat([w, ids.float()], dim=1)

    assert_rows_invariant(run, rows, i)


def test_empty_batch():
    w, ids = router_softmax_topk(torch.randn(0, 8), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    w, ids = router_sigmoid_grouped(torch.randn(0, 8), torch.zeros(8), 2, 2, 1, True, 1.0)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


def test_bad_args():
    with pytest.raises(ValueError):
        router_softmax_topk(torch.randn(2, 4), 5, True)
    with pytest.raises(ValueError):
        router_sigmoid_grouped(torch.randn(2, 9), torch.zeros(9), 2, 2, 1, True, 1.0)


# ----------------------------------------------------------------------------- the selection step


@triton.jit
def _take_max_probe(x_ptr, avail_ptr, m_ptr, i_ptr, C: tl.constexpr, STEPS: tl.constexpr):
    cols = tl.arange(0, C)
    x = tl.load(x_ptr + cols)[None, :]
    avail = (tl.load(avail_ptr + cols) != 0)[None, :]
    for j in tl.static_range(STEPS):
        m, idx, avail = _take_max(x, avail, cols, C)
        tl.store(m_ptr + j + tl.arange(0, 1), m)
        tl.store(i_ptr + j + tl.arange(0, 1), idx)


def test_take_max_is_max_value_at_its_lowest_column():
    """The routers' selection step (one int64-key reduction): the largest available value, ties (-0.0 and
    +0.0 among them) to the lowest column, negatives and -inf ordered as floats, unavailable columns
    never chosen; step by step against a plain reference."""
    x = torch.tensor([-0.5, 3.0, -0.0, 0.0, 3.0, float("-inf"), -7.25, 1e-30, -1e-30, 0.0, float("-inf"), 2.0,
                      -3.0, 3.0, 1.5, -0.5])
    avail = torch.ones(16, dtype=torch.int32)
    avail[13] = 0                                  # a maximum that is not available
    m = torch.full((16,), float("nan"))
    i = torch.full((16,), -1, dtype=torch.int32)
    dev = default_device()
    xm, av, mm, ii = (t.to(dev) for t in (x, avail, m, i))
    _take_max_probe[(1,)](xm, av, mm, ii, C=16, STEPS=15)
    ref_i, left = [], [c for c in range(16) if avail[c]]
    for _ in range(15):
        best = max(left, key=lambda c: (float(x[c]), -c))
        ref_i.append(best)
        left.remove(best)
    assert ii.cpu().tolist()[:15] == ref_i
    assert torch.equal(mm.cpu()[:15], (x[ref_i] + 0.0).cpu())   # the values, -0.0 read as +0.0
