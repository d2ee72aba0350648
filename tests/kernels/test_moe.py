"""Routed MoE experts: vs reference (per-dtype tolerances, odd shapes), vs HF's experts module,
NaN-poisoned outputs, and row batch invariance with rows sharing experts."""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (a jit function's globals must hold it)
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.backend import (
    FP8_LAYOUT_BARRIER,
    INTERPRET,
    default_device,  # noqa: F401
)
from ds4t.kernels import moe as M
from ds4t.kernels.config import differs_only_in
from ds4t.kernels.moe import moe_experts, moe_experts_ref
from ds4t.kernels.registry import GPU, HOST_LIST, INTERP, use_variants
from tests.kernels.devices import gen
from tests.kernels.invariance import (assert_rows_invariant, half_row_tiles, launcher_path, poison_empty,
                                      poisoned)

pytestmark = pytest.mark.usefixtures("on_kernel_device")

# relative to max |ref|: bf16/fp16 round the activation before each product, so one-ulp flips of a
# rounded activation between kernel and reference (different fp32 summation order) are allowed
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}
DTYPES = list(TOL)


def _weights(E, I, D, dtype, seed):
    g = gen(seed)
    wg = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(dtype)
    wu = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(dtype)
    wd = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
    return wg, wu, wd


def _routing(B, E, k, seed, n_hot=None):
    """ids [B, k] (distinct per row; from the first n_hot experts when given) and weights [B, k]."""
    g = gen(seed)
    pool = E if n_hot is None else n_hot
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(B)]).to(torch.int32)
    w = torch.rand(B, k, generator=g) + 0.1
    return ids, w


@pytest.fixture(params=["rows", "grouped", "grouped-host-list"])
def path(request):
    """Run a case with the interpreter's one-launch path (``rows``) and with the grouped kernels the
    GPU runs (``grouped``: programs find their expert on the device; in the interpreter too), and
    the grouped kernels reading a host-made expert list (the interpreter's way)."""
    if request.param == "rows" and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    variant = {"rows": INTERP, "grouped": GPU, "grouped-host-list": HOST_LIST}[request.param]
    with use_variants({"moe_experts": variant}):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,E,k,D,I,n_hot", [
    (5, 8, 2, 48, 40, None),
    (7, 10, 3, 48, 40, None),
    (40, 4, 2, 64, 32, None),    # ~20 pairs per expert: two M tiles per expert
    (3, 10, 3, 200, 72, 4),      # D, I larger than one tile on the GPU, experts 4..9 unused
])
def test_moe_vs_ref(path, dtype, B, E, k, D, I, n_hot):
    wg, wu, wd = _weights(E, I, D, dtype, seed=B + E)
    ids, w = _routing(B, E, k, seed=D, n_hot=n_hot)
    h = torch.randn(B, D, generator=gen(1))
    out = poisoned((B, D))
    res = moe_experts(h, ids, w, wg, wu, wd, out=out)
    assert res is out
    ref = moe_experts_ref(h, ids, w, wg, wu, wd)
    assert not torch.isnan(res).any()
    err = ((res - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], err


def test_moe_fp32_close_to_fp64():
    E, I, D, B, k = 8, 40, 48, 6, 2
    wg, wu, wd = _weights(E, I, D, torch.float32, 5)
    ids, w = _routing(B, E, k, 6)
    h = torch.randn(B, D)
    ref = torch.zeros(B, D, dtype=torch.float64)
    for b in range(B):
        for j in range(k):
            e = int(ids[b, j])
            x = h[b].double()
            a = torch.nn.functional.silu(wg[e].double() @ x) * (wu[e].double() @ x)
            ref[b] += w[b, j].double() * (wd[e].double() @ a)
    res = moe_experts(h, ids, w, wg, wu, wd)
    torch.testing.assert_close(res.double(), ref, rtol=1e-5, atol=1e-6)


def test_moe_zero_weight_rank_adds_nothing():
    # the rank sum starts at 0 and adds w * y in rank order: a rank with weight 0 changes no bit
    E, I, D = 8, 40, 48
    wg, wu, wd = _weights(E, I, D, torch.float32, 9)
    h = torch.randn(2, D)
    ids = torch.tensor([[3, 5], [3, 3]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.0], [0.7, 0.0]])
    one = moe_experts(h, ids[:, :1], w[:, :1], wg, wu, wd)
    two = moe_experts(h, ids, w, wg, wu, wd)
    assert torch.equal(one, two)


def test_moe_vs_hf_experts():
    """Semantics check against HF's Qwen3NextExperts (fused gate_up_proj, silu, weighted sum)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts

    E, k, D, I, B = 8, 2, 64, 32, 9
    cfg = Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I)
    ex = Qwen3NextExperts(cfg)
    g = gen(4)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
        ex.down_proj.copy_(torch.randn(E, D, I, generator=g) / I ** 0.5)
    h = torch.randn(B, D, generator=g)
    ids, w = _routing(B, E, k, 3)
    ids[1] = ids[0]
    with torch.no_grad():
        hf = ex(h, ids.long(), w)
        gu = ex.gate_up_proj.detach()
        # HF's fused layout splits into strided views; the launcher takes them as they are
        res = moe_experts(h, ids, w, gu[:, :I], gu[:, I:], ex.down_proj.detach())
    torch.testing.assert_close(res, hf, rtol=1e-5, atol=1e-5)


def test_moe_int64_ids_and_empty():
    E, I, D = 8, 40, 48
    wg, wu, wd = _weights(E, I, D, torch.bfloat16, 1)
    ids, w = _routing(4, E, 2, 2)
    h = torch.randn(4, D)
    assert torch.equal(moe_experts(h, ids, w, wg, wu, wd), moe_experts(h, ids.long(), w, wg, wu, wd))
    out = moe_experts(h[:0], ids[:0], w[:0], wg, wu, wd)
    assert out.shape == (0, D)


def test_moe_bad_shapes():
    wg, wu, wd = _weights(8, 40, 48, torch.float32, 1)
    with pytest.raises(ValueError):
        moe_experts(torch.randn(2, 47), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2), wg, wu, wd)
    h, ids, w = torch.randn(2, 48), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    with pytest.raises(ValueError, match="shared_expert=8"):
        moe_experts(h, ids, w, wg, wu, wd, shared_expert=8)
    with pytest.raises(ValueError, match="without shared_expert"):
        moe_experts(h, ids, w, wg, wu, wd, shared_gate=torch.zeros(2))
    with pytest.raises(ValueError, match="shared_gate must be"):
        moe_experts(h, ids, w, wg, wu, wd, shared_expert=7, shared_gate=torch.zeros(3))
    with pytest.raises(ValueError, match="k = 0"):
        moe_experts(h, ids[:, :0], w[:, :0], wg, wu, wd)


@pytest.mark.parametrize("shared", [False, True])
def test_skipped_pairs_add_exactly_zero(path, shared):
    """Expert parallel: ids -1 (experts another rank holds) are skipped whatever their weight; the
    row equals the same row with only its valid ranks, and rows with no valid rank are 0 (or the
    shared expert alone). The output is poisoned, y of a skipped pair is never written."""
    E, I, D, B = 6, 40, 48, 5
    wg, wu, wd = _weights(E, I, D, torch.float32, 11)
    h = torch.randn(B, D, generator=gen(12))
    ids = torch.tensor([[2, -1, 4], [-1, -1, -1], [5, 0, -1], [-1, 3, 3], [1, 2, 3]], dtype=torch.int32)
    w = torch.rand(B, 3, generator=gen(13)) + 0.5       # weights on skipped pairs are ignored
    kw = dict(shared_expert=E - 1) if shared else {}
    res = moe_experts(h, ids, w, wg, wu, wd, out=poisoned((B, D)), **kw)
    zeroed = torch.where(ids >= 0, w, torch.zeros_like(w))
    same = moe_experts(h, ids.clamp(min=0), zeroed, wg, wu, wd, **kw)   # the valid pairs, the rest weight 0
    assert torch.equal(res, same)
    if not shared:
        assert torch.equal(res[1], torch.zeros(D))
    ref = moe_experts_ref(h, ids, w, wg, wu, wd, **kw)
    torch.testing.assert_close(res, ref, rtol=2e-6, atol=2e-6)
    for b in range(B):   # row invariance holds with skipped pairs
        assert torch.equal(res[b], moe_experts(h[b:b + 1], ids[b:b + 1], w[b:b + 1], wg, wu, wd, **kw)[0])



# ----------------------------------------------------------------------------- shared expert rank

@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_shared_expert_is_the_last_rank(path, gated, k):
    """``shared_expert`` = one more rank per row, expert s, weight sigmoid(gate) or 1: the same bits
    as passing that rank in ids/weights explicitly (weights from the kernel's own sigmoid), and
    close to the reference."""
    E, I, D, B = 9, 40, 48, 7
    wg, wu, wd = _weights(E, I, D, torch.bfloat16, seed=3)
    ids, w = _routing(B, E - 1, max(k, 1), seed=4)
    ids, w = ids[:, :k], w[:, :k]
    h = torch.randn(B, D, generator=gen(5))
    logits = torch.randn(B, 3, generator=gen(6))
    gate = logits[:, 2] if gated else None       # a strided column, as a router row gives it
    res = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, shared_gate=gate, out=poisoned((B, D)))
    ref = moe_experts_ref(h, ids, w, wg, wu, wd, shared_expert=E - 1, shared_gate=gate)
    assert not torch.isnan(res).any()
    assert ((res - ref).abs().max() / ref.abs().max()).item() <= TOL[torch.bfloat16]
    if not gated and k > 0:
        ids_x = torch.cat([ids, torch.full((B, 1), E - 1, dtype=ids.dtype)], 1)
        w_x = torch.cat([w, torch.ones(B, 1)], 1)
        assert torch.equal(res, moe_experts(h, ids_x, w_x, wg, wu, wd))
    # rows stay independent with the extra rank
    assert torch.equal(res[3], moe_experts(h[3:4], ids[3:4], w[3:4], wg, wu, wd, shared_expert=E - 1,
                                           shared_gate=None if gate is None else gate[3:4])[0])


@pytest.mark.skipif(not INTERPRET, reason="the rows path is the interpreter's")
@pytest.mark.parametrize("gated", [False, True])
def test_rows_path_equals_grouped_with_shared_expert(gated):
    E, I, D, B, k = 9, 32, 64, 6, 2
    wg, wu, wd = _weights(E, I, D, torch.float32, seed=11)
    ids, w = _routing(B, E - 1, k, seed=12)
    h = torch.randn(B, D, generator=gen(13))
    gate = torch.randn(B, generator=gen(14)) if gated else None
    with use_variants({"moe_experts": INTERP}):
        rows = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, shared_gate=gate)
    with use_variants({"moe_experts": GPU}):
        assert torch.equal(rows, moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, shared_gate=gate))


@pytest.mark.parametrize("B,k,E,shared", [(1, 1, 4, None), (5, 3, 7, None), (6, 2, 9, 8), (300, 4, 33, 32),
                                          (3, 0, 5, 2)])
def test_group_pairs_is_a_stable_sort_by_expert(B, k, E, shared):
    """order/bounds of the grouping kernel equal a stable sort of the pair experts (300 x 5 pairs:
    more than one 1024-pair scan chunk)."""
    g = gen(B + E)
    ids = torch.randint(0, E if shared is None else E - 1, (B, k), generator=g, dtype=torch.int64).to(torch.int32)
    order, bounds = M.group_pairs(ids, E, shared)
    pair_e = ids.long() if shared is None else torch.cat([ids.long(), torch.full((B, 1), shared, device=ids.device)], 1)
    pair_e = pair_e.reshape(-1).cpu()
    want_sorted, want_order = torch.sort(pair_e, stable=True)
    assert torch.equal(order.cpu().long(), want_order)
    assert torch.equal(bounds.cpu().long(), torch.searchsorted(want_sorted, torch.arange(E + 1, device="cpu")))


# ----------------------------------------------------------------------------- batch invariance

POOL = 33
_E, _K, _D, _I = 8, 2, 48, 40
# rows drawn from 3 hot experts (plus a few elsewhere): many rows share an expert (up to ~22 pairs,
# so a pair sits anywhere in an expert's first or second 16-row tile)
with torch.device(default_device()):
    _H = torch.randn(POOL, _D, generator=gen(21))
    _IDS, _W = _routing(POOL, _E, _K, seed=22, n_hot=3)
    _IDS[::5, 1] = 6
    _WEIGHTS = {dt: _weights(_E, _I, _D, dt, 23) for dt in (torch.float32, torch.bfloat16)}


def _rows():
    # a random order of a random-size subset of the pool, and one position in it
    return st.tuples(st.permutations(range(POOL)), st.integers(1, POOL)).map(lambda t: t[0][: t[1]]).flatmap(
        lambda rows: st.tuples(st.just(rows), st.integers(0, len(rows) - 1)))


@settings(max_examples=12, deadline=None)
@given(
    _rows(),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.booleans(),
)
def test_moe_rows_invariant(case, dtype, rows_path):
    rows, i = case
    wg, wu, wd = _WEIGHTS[dtype]

    def run(rs):
        return moe_experts(_H[rs], _IDS[rs], _W[rs], wg, wu, wd, out=poisoned((len(rs), _D)))

    with launcher_path(M, rows_path):
        assert_rows_invariant(run, rows, i)


@pytest.mark.skipif(not INTERPRET, reason="the rows path is the interpreter's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,E,k,D,I", [(1, 9, 3, 64, 32), (8, 9, 3, 64, 32), (33, 8, 2, 48, 40), (3, 6, 2, 300, 260)])
def test_rows_path_equals_grouped_kernels(dtype, B, E, k, D, I):
    """The interpreter's one-launch path does the grouped kernels' arithmetic in their order: the
    same bits (D, I of 300, 260: several K chunks and I tiles)."""
    wg, wu, wd = _weights(E, I, D, dtype, seed=7)
    ids, w = _routing(B, E, k, seed=8)
    h = torch.randn(B, D, generator=gen(9))
    with use_variants({"moe_experts": INTERP}):
        rows = moe_experts(h, ids, w, wg, wu, wd)
    with use_variants({"moe_experts": GPU}):
        grouped = moe_experts(h, ids, w, wg, wu, wd)
    assert torch.equal(rows, grouped)


@pytest.mark.parametrize("device_list", [False, True])
def test_grouped_paths_agree_bitwise(device_list):
    """The expert slot a program runs changes no bit: device-found slots == host-listed experts,
    with experts unchosen between chosen ones (E = 40, 6 rows x 3 ranks)."""
    E, I, D, B, k = 40, 32, 64, 6, 3
    wg, wu, wd = _weights(E, I, D, torch.bfloat16, seed=21)
    ids, w = _routing(B, E, k, seed=22)
    h = torch.randn(B, D, generator=gen(23))
    first, second = (GPU, HOST_LIST) if device_list else (HOST_LIST, GPU)
    with use_variants({"moe_experts": first}):
        a = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, out=poisoned((B, D)))
    with use_variants({"moe_experts": second}):
        b = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, out=poisoned((B, D)))
    assert not torch.isnan(a).any() and torch.equal(a, b)


def test_moe_row_invariant_with_duplicates_of_itself():
    # a row among many copies of itself and other rows (its pair lands at every tile position)
    wg, wu, wd = _WEIGHTS[torch.float32]
    rows = [3] + [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11] * 3
    full = moe_experts(_H[rows], _IDS[rows], _W[rows], wg, wu, wd)
    alone = moe_experts(_H[3:4], _IDS[3:4], _W[3:4], wg, wu, wd)
    assert torch.equal(full[0], alone[0])
    for j, r in enumerate(rows):
        if r == 3:
            assert torch.equal(full[j], alone[0])
    rows = [0] * 20
    full = moe_experts(_H[rows], _IDS[rows], _W[rows], wg, wu, wd)
    alone = moe_experts(_H[0:1], _IDS[0:1], _W[0:1], wg, wu, wd)
    assert all(torch.equal(full[j], alone[0]) for j in range(20))


# ----------------------------------------------------------------------------- FP8 weights (W8A16)

# relative to max |ref|, by activation dtype (the reference dequantizes, fp8 * scale in fp32)
FP8_TOL = {torch.float32: 1e-5, torch.bfloat16: TOL[torch.bfloat16], torch.float16: TOL[torch.float16]}


def _fp8_weights(E, I, D, seed, block_k=128):
    from ds4t.kernels.weights import quantize

    wg, wu, wd = _weights(E, I, D, torch.float32, seed)
    # experts and rows of different magnitudes: the block scales differ
    g = gen(seed + 100)
    wg = wg * (1 + 3 * torch.rand(E, I, 1, generator=g))
    wd = wd * (1 + 3 * torch.rand(E, 1, 1, generator=g))
    return tuple(quantize(w, (128, block_k)) for w in (wg, wu, wd))


@pytest.mark.parametrize("adt", DTYPES, ids=str)
@pytest.mark.parametrize("B,E,k,D,I,bk", [
    (5, 8, 2, 48, 40, 128),
    (3, 10, 3, 300, 260, 128),   # D, I over several scale blocks, the last ragged
    (7, 6, 2, 200, 136, 64),     # 64-column scale blocks
])
def test_fp8_moe_vs_ref(path, adt, B, E, k, D, I, bk):
    wg, wu, wd = _fp8_weights(E, I, D, seed=B + E, block_k=bk)
    ids, w = _routing(B, E - 1, k, seed=D)
    h = torch.randn(B, D, generator=gen(1)).to(adt)      # activation dtype = h's own
    out = poisoned((B, D))
    res = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, out=out)
    assert res is out and not torch.isnan(res).any()
    ref = moe_experts_ref(h, ids, w, wg, wu, wd, shared_expert=E - 1)
    assert ((res - ref).abs().max() / ref.abs().max()).item() <= FP8_TOL[adt]


def test_fp8_moe_fp32_close_to_fp64():
    E, I, D, B, k = 8, 40, 200, 6, 2
    wg, wu, wd = _fp8_weights(E, I, D, 5)
    ids, w = _routing(B, E, k, 6)
    h = torch.randn(B, D, generator=gen(7))
    fg, fu, fd = (x.data.double() * x.scale.double().repeat_interleave(128, -1)[..., :x.shape[-1]]
                  for x in (wg, wu, wd))
    ref = torch.zeros(B, D, dtype=torch.float64, device=h.device)
    for b in range(B):
        for j in range(k):
            e = int(ids[b, j])
            x = h[b].double()
            a = torch.nn.functional.silu(fg[e] @ x) * (fu[e] @ x)
            ref[b] += w[b, j].double() * (fd[e] @ a)
    res = moe_experts(h, ids, w, wg, wu, wd)
    assert ((res.double() - ref).abs().max() / ref.abs().max()).item() < 2e-6
    # act_dtype=bf16 rounds h and silu(g)*u (visibly), and matches its reference
    resb = moe_experts(h, ids, w, wg, wu, wd, act_dtype=torch.bfloat16)
    refb = moe_experts_ref(h, ids, w, wg, wu, wd, act_dtype=torch.bfloat16)
    assert ((resb - refb).abs().max() / refb.abs().max()).item() <= FP8_TOL[torch.bfloat16]
    assert (resb.double() - ref).abs().max() > 1e-4


@pytest.mark.skipif(not INTERPRET, reason="the rows path is the interpreter's")
@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,E,k,D,I,bk,tiles", [(1, 9, 3, 64, 32, 128, None), (8, 9, 3, 300, 260, 128, None),
                                                (6, 7, 2, 200, 136, 64, None), (6, 7, 2, 200, 136, 64, 32)])
def test_fp8_rows_path_equals_grouped_kernels(monkeypatch, adt, B, E, k, D, I, bk, tiles):
    """The interpreter's one-launch path does the grouped kernels' FP8 arithmetic in their order (and
    the device-found expert slots equal the host list): the same bits. With 32-column K tiles a scale
    block holds several sub-tiles, and the grouped kernels run whole masked sub-tiles past D / I that
    the rows path skips (adding +0 to a block sum changes no bit)."""
    from ds4t.kernels.interp import moe_rows

    if tiles is not None:
        small = M.MoEConfig(tile_n=tiles, tile_k=tiles)
        monkeypatch.setattr(M, "_INTERP_CONFIG", small)
        monkeypatch.setattr(moe_rows, "_INTERP_CONFIG", small)
    wg, wu, wd = _fp8_weights(E, I, D, seed=7, block_k=bk)
    ids, w = _routing(B, E - 1, k, seed=8)
    h = torch.randn(B, D, generator=gen(9))
    gate = torch.randn(B, generator=gen(10))
    got = {}
    for v in (INTERP, GPU, HOST_LIST):
        with use_variants({"moe_experts": v}):
            got[v] = moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, shared_gate=gate, act_dtype=adt,
                                 out=poisoned((B, D)))
    assert not torch.isnan(got[GPU]).any()
    assert torch.equal(got[INTERP], got[GPU]) and torch.equal(got[GPU], got[HOST_LIST])


@triton.jit
def _no_store_slot(slots_ptr, e, start, end, writer):
    """``moe._store_slot`` switched off (the negative control below)."""
    pass


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which only the interpreter looks up at call time")
def test_down_kernel_reads_the_slots_gate_up_writes(monkeypatch):
    """The device-list path: the down kernel takes each slot's expert from the list the gate/up kernel
    writes (``moe._store_slot``). Every int32 buffer the launcher allocates starts poisoned as a list of
    expert 0, which no row chose: the result is still the host list's, bit for bit. Negative control: with
    the gate/up kernel's store switched off the poison reaches the down kernel and the result differs."""
    E, I, D, B, k = 6, 40, 48, 3, 2
    wg, wu, wd = _weights(E, I, D, torch.float32, 41)
    ids, w = _routing(B, E - 1, k, seed=42)
    ids = ids + 1   # experts 1 .. E-1: expert 0 is never chosen
    h = torch.randn(B, D, generator=gen(43))
    with use_variants({"moe_experts": HOST_LIST}):
        want = moe_experts(h, ids, w, wg, wu, wd)
    empty = torch.empty

    def int_zeroed(*shape, dtype=None, **kw):
        t = empty(*shape, dtype=dtype, **kw)
        return t.zero_() if dtype == torch.int32 else t

    monkeypatch.setattr(M.torch, "empty", int_zeroed)
    monkeypatch.setattr(M, "SELF_GROUP_PAIRS", 0)   # the grouping kernel and the slots list, at any size
    with use_variants({"moe_experts": GPU}):
        assert torch.equal(moe_experts(h, ids, w, wg, wu, wd, out=poisoned((B, D))), want)
        monkeypatch.setattr(M, "_store_slot", _no_store_slot)
        assert not torch.equal(moe_experts(h, ids, w, wg, wu, wd, out=poisoned((B, D))), want)


_SELF_SLOT = M._self_slot


@triton.jit
def _first_pair_only(ids_ptr, si_b, P, KT, SHARED, KR: tl.constexpr, BM: tl.constexpr):
    """A broken :func:`ds4t.kernels.moe._self_slot`: every expert runs its first pair only."""
    e, pairs, count = _SELF_SLOT(ids_ptr, si_b, P, KT, SHARED, KR, BM)
    return e, pairs, tl.minimum(count, 1)


def _self_cases():
    E, I, D = 7, 64, 96
    for dtype in (torch.float32, torch.bfloat16):
        yield str(dtype), _weights(E, I, D, dtype, 51)


@pytest.mark.parametrize("B,k,shared,skipped", [
    (1, 3, None, False), (1, 3, 6, False), (1, 7, None, False),   # one row: k (+ 1) pairs, one per expert
    (4, 3, 6, False),    # 16 pairs: the shared expert's 4 in one slot, routed experts repeated across rows
    (5, 3, None, True),  # 15 pairs, some ids -1 (another rank's experts): those pairs add exactly 0
])
def test_a_few_pairs_group_themselves_with_the_grouped_bits(monkeypatch, B, k, shared, skipped):
    """A launch of at most SELF_GROUP_PAIRS pairs over float experts runs no grouping kernel (each program finds
    its slot's pairs from the ids) and gives the grouped kernels' bits. Negative control: a self-grouping that
    keeps only an expert's first pair differs wherever an expert has two."""
    for name, (wg, wu, wd) in _self_cases():
        E = wg.shape[0]
        g = gen(B * 10 + k)
        ids = torch.stack([torch.randperm(E - 1 if shared else E, generator=g)[:k] for _ in range(B)]).to(torch.int32)
        if skipped:
            ids[::2, 0] = -1
        w = torch.rand(B, k, generator=g) + 0.1
        h = torch.randn(B, wg.shape[-1], generator=g)
        gate = torch.randn(B, generator=g) if shared is not None else None
        args = (h, ids, w, wg, wu, wd)
        kw = dict(shared_expert=shared, shared_gate=gate)
        with use_variants({"moe_experts": GPU}):
            monkeypatch.setattr(M, "SELF_GROUP_PAIRS", 0)
            want = moe_experts(*args, **kw, out=poisoned((B, h.shape[1])))
            monkeypatch.setattr(M, "SELF_GROUP_PAIRS", M.BLOCK_M)
            with monkeypatch.context() as m:
                m.setattr(M, "group_pairs", lambda *a, **k: pytest.fail("a few pairs ran the grouping kernel"))
                got = moe_experts(*args, **kw, out=poisoned((B, h.shape[1])))
            assert torch.equal(got, want), name
            if shared is not None and B > 1 and INTERPRET:   # (a compiled kernel has its helpers inlined)
                with monkeypatch.context() as m:
                    m.setattr(M, "_self_slot", _first_pair_only)
                    assert not torch.equal(moe_experts(*args, **kw, out=poisoned((B, h.shape[1]))), want), name
        ref = moe_experts_ref(*args, **kw)
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= TOL[wg.dtype], name


def test_fp8_and_gguf_experts_keep_the_grouping_kernel(monkeypatch):
    """FP8 and GGUF experts group their pairs with the grouping kernel at every size (self-grouping timed
    slower there on an H200: SELF_GROUP_PAIRS)."""
    from ds4t.kernels.quant_blocks import quantize as gguf_quantize
    from ds4t.kernels.weights import quantize as fp8_quantize

    wg, wu, wd = _weights(4, 64, 96, torch.float32, 52)
    ids, w = _routing(1, 4, 2, seed=53)
    h = torch.randn(1, 96, generator=gen(54))
    calls = []
    real = M.group_pairs
    monkeypatch.setattr(M, "group_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    with use_variants({"moe_experts": GPU}):
        for ws in ([fp8_quantize(x, (32, 32)) for x in (wg, wu, wd)], [gguf_quantize(x, "Q8_0") for x in (wg, wu, wd)]):
            moe_experts(h, ids, w, *ws)
            assert len(calls) == 1
            calls.clear()


def test_fp8_fused_gate_up_views(path):
    """HF's fused gate_up [E, 2I, D] quantized as one tensor, split into row views (as the loader
    does): the same bits as contiguous copies."""
    from ds4t.kernels.weights import quantize

    E, I, D, B, k = 6, 40, 200, 5, 2
    g = gen(31)
    gu = quantize(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
    wd = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5)
    wg, wu = gu[:, :I], gu[:, I:]
    assert not wg.data.is_contiguous()
    ids, w = _routing(B, E, k, 32)
    h = torch.randn(B, D, generator=g)
    views = moe_experts(h, ids, w, wg, wu, wd)
    copies = moe_experts(h, ids, w, wg.contiguous(), wu.contiguous(), wd)
    assert torch.equal(views, copies)
    ref = moe_experts_ref(h, ids, w, wg, wu, wd)
    assert ((views - ref).abs().max() / ref.abs().max()).item() <= FP8_TOL[torch.float32]


def test_fp8_bad_weights():
    from ds4t.kernels.weights import quantize

    wg, wu, wd = _fp8_weights(4, 40, 48, 1)
    fg, fu, fd = _weights(4, 40, 48, torch.float32, 1)
    h, ids, w = torch.randn(2, 48, generator=gen(2)), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    h, ids, w = h, ids.to(h.device), w.to(h.device)
    with pytest.raises(TypeError):
        moe_experts(h, ids, w, wg, fu, wd)
    with pytest.raises(ValueError, match="block_k"):
        moe_experts(h, ids, w, wg, wu, quantize(wd.dequantize(), (128, 64)))
    with pytest.raises(ValueError, match="act_dtype"):
        moe_experts(h, ids, w, fg, fu, fd, act_dtype=torch.bfloat16)


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_launch_size_changes_no_bit(path, adt):
    """The prefill property: 64 rows computed in launches of 64, 17 (+13) and 1 rows are bitwise equal."""
    E, I, D, k = 8, 40, 200, 2
    wg, wu, wd = _fp8_weights(E, I, D, 41)
    ids, w = _routing(64, 4, k, seed=42)     # 4 hot experts: up to ~32 pairs share one (two M tiles)
    h = torch.randn(64, D, generator=gen(43))

    def run(a, b):
        return moe_experts(h[a:b], ids[a:b], w[a:b], wg, wu, wd, shared_expert=E - 1, act_dtype=adt)

    whole = run(0, 64)
    assert torch.equal(whole, torch.cat([run(i, i + 17) for i in range(0, 64, 17)]))
    assert all(torch.equal(whole[i:i + 1], run(i, i + 1)) for i in (0, 5, 16, 17, 31, 63))


with torch.device(default_device()):
    _FP8_WEIGHTS = _fp8_weights(_E, _I, _D, 24)


@settings(max_examples=10, deadline=None)
@given(_rows(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_fp8_moe_rows_invariant(case, adt, rows_path):
    rows, i = case
    wg, wu, wd = _FP8_WEIGHTS

    def run(rs):
        return moe_experts(_H[rs], _IDS[rs], _W[rs], wg, wu, wd, act_dtype=adt, out=poisoned((len(rs), _D)))

    with launcher_path(M, rows_path):
        assert_rows_invariant(run, rows, i)


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_routes(adt):
    """The grouped kernels' fp8 routes (ds4t.backend.FP8_ROUTES): "f32" gives the bits of "direct";
    "tf32", "fold", "x2" and "f16" (bf16 activations) match the reference and are row-invariant, "fold" equals
    the reference on weights rounded to the activation dtype; fp32 activations refuse all four."""
    E, I, D, k = 6, 40, 200, 2
    wg, wu, wd = _fp8_weights(E, I, D, 51)
    ids, w = _routing(9, E - 1, k, seed=52)
    h = torch.randn(9, D, generator=gen(53))

    def run(route, rows=slice(None)):
        cfg = M.MoEConfig(tile_n=32, tile_k=64, fp8_route=route)
        with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(lambda kernel, *fmt: cfg):
            return moe_experts(h[rows], ids[rows], w[rows], wg, wu, wd, shared_expert=E - 1, act_dtype=adt,
                               out=poisoned((h[rows].shape[0], D)))

    y0, y1 = run("direct"), run("f32")
    assert not torch.isnan(y1).any() and torch.equal(y0, y1)
    if adt == torch.float32:
        for route in ("tf32", "fold", "x2", "f16"):
            with pytest.raises(ValueError, match=route):
                run(route)
        return
    ref = moe_experts_ref(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=adt)
    for route in ("tf32", "fold", "x2", "f16"):
        y = run(route)
        assert not torch.isnan(y).any()
        assert all(torch.equal(y[i:i + 1], run(route, slice(i, i + 1))) for i in (0, 4, 8)), route
        assert ((y - ref).abs().max() / ref.abs().max()).item() <= FP8_TOL[adt], route
    # "fold" is the reference on weights rounded once to the activation dtype (up to fp32 sums)
    wf = [x.dequantize(torch.float32).to(adt) for x in (wg, wu, wd)]   # activations round to their dtype
    folded = moe_experts_ref(h, ids, w, *wf, shared_expert=E - 1)
    y3 = run("fold")
    assert ((y3 - folded).abs().max() / folded.abs().max()).item() < 1e-4
    assert not torch.equal(y3, y1)


@pytest.mark.parametrize("swap", [False, True], ids=["xw", "swap"])
def test_fp8_route_f16_has_the_f32_bits(swap):
    """Route "f16" in the grouped kernels: fp16 weight tiles, each pair's activations scaled by one power of
    two over the program's columns, every product exact, every sum the "f32" route's in scaled units -- so
    the interpreter gives the "f32" bits with unswapped tiles at any K tile (swapped, numpy's sum order
    follows the transposed operand's memory layout, which differs between the routes: last-bit
    differences). Control: the same comparison across K tiles (64 vs 128: the MMA sums differently) differs.
    Within the bound everywhere, on the GPU too; rows far apart in magnitude."""
    E, I, D, k = 6, 256, 384, 2
    wg, wu, wd = _fp8_weights(E, I, D, 61)
    ids, w = _routing(9, E - 1, k, seed=62)
    h = torch.randn(9, D, generator=gen(63)) * torch.logspace(-3, 3, 9)[:, None]

    def run(route, tile_k=128):
        cfg = M.MoEConfig(tile_n=64, tile_k=tile_k, fp8_route=route, swap=swap, num_warps=4)
        with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(lambda kernel, *fmt: cfg):
            return moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=torch.bfloat16,
                               out=poisoned((9, D)))

    ref = moe_experts_ref(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=torch.bfloat16)
    for tile_k in (128, 64):
        y16 = run("f16", tile_k)
        assert not torch.isnan(y16).any()
        assert ((y16 - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max().item() < 1e-5
        if INTERPRET and not swap:
            assert torch.equal(y16, run("f32", tile_k))
    if INTERPRET and not swap:
        assert not torch.equal(run("f16", 64), run("f32", 128))


def _config_case(fmt, adt, D, I, seed, gate_up, down):
    """moe_experts with ``gate_up`` / ``down`` forced (grouped kernels): the reference within the dtype's
    bound, NaN-poisoned outputs overwritten, and each row alone bitwise what it is in a batch in which two
    experts hold more than one 16-pair tile. Returns (y, run, ref, tol)."""
    E, k, B = 6, 3, 24
    if fmt == "fp8":
        wg, wu, wd = _fp8_weights(E, I, D, seed)
        tol = FP8_TOL[adt]
    else:
        wg, wu, wd = _weights(E, I, D, torch.bfloat16, seed)
        tol = TOL[torch.bfloat16]
    ids, w = _routing(B, E - 1, k, seed=seed + 1)
    h = torch.randn(B, D, generator=gen(seed + 2))

    def run(rows=slice(None), gu=gate_up, dn=down):
        with use_variants({"moe_experts": GPU}), \
                M.MOE_CONFIGS.forced(lambda kernel, *f: gu if kernel == "gate_up" else dn):
            return moe_experts(h[rows], ids[rows], w[rows], wg, wu, wd, shared_expert=E - 1, act_dtype=adt,
                               out=poisoned((h[rows].shape[0], D)))

    y = run()
    assert not torch.isnan(y).any()
    ref = moe_experts_ref(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=adt)
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= tol
    assert all(torch.equal(y[i:i + 1], run(slice(i, i + 1))) for i in (0, 11, 23))
    return y, run, ref, tol


@pytest.mark.parametrize("fmt,route,adt,tile_n,warps", [
    ("bf16", "direct", None, 32, 2),
    ("fp8", "f32", torch.float32, 32, 2),
    ("fp8", "f32", torch.bfloat16, 32, 2),
    ("fp8", "tf32", torch.bfloat16, 32, 2),
    ("fp8", "x2", torch.bfloat16, 64, 4),    # a warpgroup over 64 weight rows: Hopper's fp8 wgmma
    ("fp8", "f16", torch.bfloat16, 32, 2),
], ids=str)
def test_swapped_tiles(fmt, route, adt, tile_n, warps):
    """``MoEConfig(swap=True)`` (the weight rows as the MMA's M side) on both kernels: see _config_case."""
    cfg = M.MoEConfig(tile_n=tile_n, tile_k=64, fp8_route=route, swap=True, num_warps=warps)
    _config_case(fmt, adt, 200, 40, 71, cfg, cfg)


@pytest.mark.parametrize("fmt,route,adt,split,swap,where", [
    ("bf16", "direct", None, 2, False, "gate_up"),
    ("bf16", "direct", None, 3, True, "down"),
    ("fp8", "f32", torch.float32, 2, True, "both"),
    # (make test-long: the f32 route with bf16 activations, each kernel alone; make test splits both)
    pytest.param("fp8", "f32", torch.bfloat16, 3, True, "gate_up", marks=pytest.mark.long),
    pytest.param("fp8", "f32", torch.bfloat16, 2, True, "down", marks=pytest.mark.long),
    ("fp8", "tf32", torch.bfloat16, 2, False, "both"),
    ("fp8", "f16", torch.bfloat16, 2, True, "both"),    # a pair's scale over its split's columns only
], ids=str)
def test_split_k(fmt, route, adt, split, swap, where):
    """``MoEConfig(split=S)`` (K in S parts whose fp32 partials the next kernel adds in split order: the down
    kernel gate_up's, the combine down's; D = 264 and I = 150: ragged last splits for S = 2 and 3): see
    _config_case; and close to the unsplit sums."""
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route=route, swap=swap)
    cut = dataclasses.replace(base, split=split)
    gu, dn = (cut if where in ("gate_up", "both") else base), (cut if where in ("down", "both") else base)
    y, run, ref, tol = _config_case(fmt, adt, 264, 150, 81, gu, dn)
    assert ((y - run(gu=base, dn=base)).abs().max() / ref.abs().max()).item() <= tol


@pytest.mark.parametrize("blocks,split,swap", [(3, 2, True)], ids=str)
def test_fp8_scale_blocks_a_step_keep_the_one_block_bits(blocks, split, swap):
    """``MoEConfig.scale_blocks``: FP8 loop steps of several 128-column scale blocks, each with the one-block
    step's operations in K order, give the one-block bits (D = 768: 6 blocks, I = 384: 3). A launch whose
    splits are not whole steps of them takes one block a step (:func:`blocks_a_step`; the same bits either
    way): here the kernel that cannot take ``blocks`` falls back, the other takes them. Control: another
    split of the same config differs (the comparison sees a change of summation order)."""
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=swap, split=split)
    many = dataclasses.replace(base, scale_blocks=blocks)
    kps = {K: M.k_per_split(K, split, 128) if split > 1 else K for K in (768, 384)}
    taken = {K: M.blocks_a_step(many, K, 128, kps[K]) for K in (768, 384)}
    assert sorted(taken.values()) == [1, blocks], taken   # one kernel takes them, the other falls back
    y, run, ref, tol = _config_case("fp8", torch.bfloat16, 768, 384, 91, many, many)
    assert torch.equal(y, run(gu=base, dn=base))
    other = dataclasses.replace(base, split=split + 1)
    assert not torch.equal(y, run(gu=other, dn=other))
    with pytest.raises(ValueError, match="scale_blocks"):
        M.blocks_a_step(dataclasses.replace(base, scale_blocks=0), 768, 128, 768)


# make test: each split count but 3, each swap, dtype and sub-tile count once (with the fp32 control);
# make test-long: split 3 over 24 rows and bf16 one-sub-tile too
@pytest.mark.parametrize("split,swap,B,adt,m_sub", [(2, True, 1, torch.float32, 1),
                                                   pytest.param(3, True, 24, torch.float32, 1, marks=pytest.mark.long),
                                                   (6, False, 5, torch.float32, 1),
                                                   pytest.param(2, True, 2, torch.bfloat16, 1, marks=pytest.mark.long),
                                                   (2, True, 24, torch.bfloat16, 2)], ids=str)
def test_fp8_ordered_split_keeps_the_unsplit_bits(device, split, swap, B, adt, m_sub):
    """``MoEConfig.ordered_split``: FP8 gate/up K splits that store every scale block's dot, added in block
    order by the activation kernel (D = 768: 6 blocks of 128), give the unsplit launch's bits at any split
    count -- so a few-rows entry may take one; with two sub-tiles a program (row programs) too. Control (fp32
    activations, which the down kernel reads unrounded): an ordinary split of the same K differs."""
    E, I, D, k = 6, 384, 768, 3
    wg, wu, wd = (w.to(device) for w in _fp8_weights(E, I, D, 93))
    ids, w = (t.to(device) for t in _routing(B, E - 1, k, seed=94))
    h = torch.randn(B, D, generator=gen(95)).to(device)
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=swap)

    def run(gate_up):
        with use_variants({"moe_experts": GPU}), \
                M.MOE_CONFIGS.forced(lambda kernel, *f: gate_up if kernel == "gate_up" else base):
            return moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=adt,
                               out=poisoned((B, D), device=device))

    sub = dict(m_sub=2, row_programs=True) if m_sub == 2 else {}
    y = run(dataclasses.replace(base, split=split, ordered_split=True, **sub))
    assert not torch.isnan(y).any()
    unsplit = run(base)
    assert torch.equal(y, unsplit)
    if adt == torch.float32:
        assert not torch.equal(run(dataclasses.replace(base, split=split)), unsplit)


def test_ordered_split_is_a_few_rows_field_only_where_the_kernel_has_it():
    """A few-rows entry may take an ordered K split (the decode entry's bits); an ordinary split is refused,
    and so is an ordered split on 16-bit weights, on the down kernel or on the "fold" route."""
    base = M.MoEConfig(tile_n=32, tile_k=128, fp8_route="f32", swap=True)
    ordered = dataclasses.replace(base, split=4, ordered_split=True, max_rows=2)
    assert M.few_entry_keeps_bits(ordered, base, "gate_up", True)
    assert not M.few_entry_keeps_bits(dataclasses.replace(ordered, ordered_split=False), base, "gate_up", True)
    assert M.sum_order(ordered, "gate_up", True) == M.sum_order(base, "gate_up", True) == "blocks"
    for cfg, kernel, fp8 in [(ordered, "gate_up", False), (ordered, "down", True),
                             (dataclasses.replace(ordered, fp8_route="fold"), "gate_up", True)]:
        with pytest.raises(ValueError, match="ordered split"):
            M.sum_order(cfg, kernel, fp8)


def test_split_must_leave_no_split_empty_and_row_tiles_keep_it():
    with pytest.raises(ValueError, match="empty"):
        M.k_per_split(256, 3, 128)
    assert M.k_per_split(520, 3, 64) == 192 and M.k_per_split(2048, 2, 128) == 1024
    base = M.MoEConfig(tile_n=32, tile_k=64, split=2)
    rows = M.MoEConfig(tile_n=64, tile_k=64, block_m=32, min_rows=8)
    with M.MOE_CONFIGS.forced(lambda kernel, *f: rows if f[-1:] == ("rows",) else base):
        with pytest.raises(ValueError, match="split"):
            M._config("gate_up", (), 16)


# ----------------------------------------------------------------------------- row tiles (prefill chunks)

def _row_tile_run(fmt, row_cfg, device, B=24, split=1):
    """(B rows in one launch, each row alone): experts 0..4 of 6 (5: shared), k = 2; the decode config
    (16-row tiles, ``split`` K splits) for one row, ``row_cfg`` (a ("rows",) entry) for B rows."""
    E, I, D, k = 6, 72, 200, 2
    if fmt == "fp8":
        wg, wu, wd = (w.to(device) for w in _fp8_weights(E, I, D, 61))
        adt = torch.bfloat16
    else:
        wg, wu, wd = (w.to(device) for w in _weights(E, I, D, torch.bfloat16, 61))
        adt = None
    ids, w = (t.to(device) for t in _routing(B, E - 1, k, seed=62))
    h = torch.randn(B, D, generator=gen(63)).to(device)
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32" if fmt == "fp8" else "direct", split=split)

    def run(rows):
        with use_variants({"moe_experts": GPU}), \
                M.MOE_CONFIGS.forced(lambda kernel, *f: row_cfg if f[-1:] == ("rows",) else base):
            return moe_experts(h[rows], ids[rows], w[rows], wg, wu, wd, shared_expert=E - 1, act_dtype=adt,
                               out=poisoned((h[rows].shape[0], D), device=device))

    return run(slice(None)), torch.cat([run(slice(i, i + 1)) for i in range(B)])


@pytest.mark.parametrize("fmt", ["bf16", pytest.param("fp8", marks=pytest.mark.skipif(
    not (INTERPRET or FP8_LAYOUT_BARRIER), reason="on an H200 an FP8 row's bits change with the tile (bench/mma_shapes.py): the GPU has "
                          "no FP8 row tiles"))])
def test_row_tile_keeps_every_pairs_bits(device, fmt):
    """A launch of >= min_rows rows runs the ("rows",) entry (32-pair tiles, 64 columns, other warps);
    every row equals that row launched alone with the decode tiles (16 pairs), bit for bit."""
    row_cfg = M.MoEConfig(tile_n=64, tile_k=64, num_warps=8, num_stages=2, block_m=32, min_rows=8,
                          fp8_route="f32" if fmt == "fp8" else "direct")
    full, alone = _row_tile_run(fmt, row_cfg, device)
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


@pytest.mark.parametrize("row_programs,split", [(True, 1), (False, 1)])
def test_fp8_sub_tiles_keep_every_pairs_bits(device, row_programs, split):
    """FP8 row entries with two 16-pair sub-tiles a program (``MoEConfig.m_sub``: each sub-tile its own dots
    on the same converted weight tiles) -- in row programs and in per-expert programs -- give
    every row the bits of that row launched alone on the decode tiles, on the GPU too (unlike a 32-pair tile)."""
    row_cfg = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", min_rows=8, m_sub=2, row_programs=row_programs,
                          split=split)
    full, alone = _row_tile_run("fp8", row_cfg, device, split=split)
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


def test_sub_tiles_need_fp8_weights_and_a_tile_scale_route():
    base = M.MoEConfig(tile_n=32, tile_k=64, m_sub=2)
    assert M.sub_tiles(base, True, False, torch.bfloat16) == 2
    assert M.sub_tiles(base, True, True, torch.bfloat16) == 1        # a self-grouped launch: one tile
    assert M.sub_tiles(base, True, False, torch.float32) == 1        # fp32 activations: one (registers)
    with pytest.raises(ValueError, match="m_sub 2 needs FP8"):
        M.sub_tiles(base, False, False, torch.bfloat16)
    with pytest.raises(ValueError, match="m_sub 2 needs FP8"):
        M.sub_tiles(dataclasses.replace(base, fp8_route="f16"), True, False, torch.bfloat16)
    with pytest.raises(ValueError, match="1 or 2"):
        M.sub_tiles(dataclasses.replace(base, m_sub=4), True, False, torch.bfloat16)


def test_sub_tiles_wait_for_enough_pairs_an_expert():
    """``m_sub_pairs``: the second sub-tile only from that many pairs an expert on average (P over E)."""
    cfg = M.MoEConfig(tile_n=32, tile_k=64, m_sub=2, m_sub_pairs=48)
    assert M.sub_tiles(cfg, True, False, torch.bfloat16, P=48 * 161, E=161) == 2
    assert M.sub_tiles(cfg, True, False, torch.bfloat16, P=48 * 161 - 1, E=161) == 1
    assert M.sub_tiles(cfg, True, False, torch.bfloat16, P=11 * 1024, E=513) == 1    # Qwen3-Next's 1024 rows


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's MMA sums per K tile; on the GPU the K tile changes no bit")
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_row_tile_control_a_changed_k_tile_is_caught(device, tma):
    """Negative control (of the descriptor loads' test too): a row entry with another K tile (the interpreter sums
    each K tile before adding it) changes the rows, and the comparison above catches it."""
    row_cfg = M.MoEConfig(tile_n=64, tile_k=32, block_m=32, min_rows=8, tma=tma)
    full, alone = _row_tile_run("bf16", row_cfg, device)
    assert not torch.equal(full, alone)


@pytest.mark.skipif(not M.TMA, reason="tensor descriptors need a Hopper GPU (or the interpreter)")
@pytest.mark.parametrize("row_programs", [True, False], ids=["row-programs", "expert-programs"])
def test_row_tile_tma_keeps_every_pairs_bits(device, monkeypatch, row_programs):
    """A row entry whose weight tiles come through tensor descriptors (``MoEConfig.tma``) gives every pair the bits
    of its row launched alone (pointer loads, decode tiles). I = 72 and D = 200 end inside a tile: the zeros past
    them come from the descriptors, as the masked loads give them."""
    row_cfg = M.MoEConfig(tile_n=64, tile_k=64, num_warps=8, num_stages=2, block_m=32, min_rows=8,
                          row_programs=row_programs, tma=True)
    took = []
    real = M.weight_descriptors
    monkeypatch.setattr(M, "weight_descriptors", lambda *a: took.append(real(*a)) or took[-1])
    full, alone = _row_tile_run("bf16", row_cfg, device)
    assert took[0].get("USE_TMA") and took[1].get("USE_TMA")   # the batch's gate/up and down launches
    assert not any(took[2:])                                    # the lone rows: decode tiles, pointer loads
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


@pytest.mark.skipif(not M.TMA, reason="tensor descriptors need a Hopper GPU (or the interpreter)")
@pytest.mark.parametrize("B, swap, row_programs", [(1, True, False), (24, True, True), (5, False, False)],
                         ids=["one-row-swap", "rows-swap", "expert-programs"])
def test_fp8_tma_keeps_every_pairs_bits(device, monkeypatch, B, swap, row_programs):
    """FP8 experts whose fp8 weight tiles come through tensor descriptors (``MoEConfig.tma``, converted in registers
    after the load) give every pair the bits of pointer loads, both kernels; I = 80 and D = 400 end inside a tile
    (zeros past them from the descriptors; fp8 rows of 80 / 400 bytes: the 16-byte strides a descriptor needs).
    Control: the same launch with fp32 activations differs."""
    E, I, D, k = 6, 80, 400, 2
    wg, wu, wd = (w.to(device) for w in _fp8_weights(E, I, D, 71))
    ids, w = (t.to(device) for t in _routing(B, E - 1, k, seed=72))
    h = torch.randn(B, D, generator=gen(73)).to(device)
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=swap, row_programs=row_programs, num_warps=2)
    took = []
    real = M.weight_descriptors
    monkeypatch.setattr(M, "weight_descriptors", lambda *a: took.append(real(*a)) or took[-1])

    def run(cfg, adt=torch.bfloat16):
        with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(lambda kernel, *f: cfg):
            return moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, act_dtype=adt,
                               out=poisoned((B, D), device=device))

    ptr = run(base)
    assert not any(took)
    took.clear()
    desc = run(dataclasses.replace(base, tma=True))
    assert len(took) == 2 and all(t.get("USE_TMA") for t in took)   # gate/up and down
    assert not torch.isnan(desc).any()
    assert torch.equal(desc, ptr)
    if B == 1:
        assert not torch.equal(run(dataclasses.replace(base, tma=True), torch.float32), ptr)


def test_tma_needs_16_bit_weights_with_16_byte_strides():
    """Where a launch cannot take descriptors it takes the pointer loads: the config does not ask, fp32 weights,
    an expert or row stride that is no multiple of 16 bytes."""
    cfg = M.MoEConfig(tile_n=32, tile_k=64, tma=True)
    w = torch.randn(4, 40, 64).to(torch.bfloat16)
    assert not M.weight_descriptors(dataclasses.replace(cfg, tma=False), {"wd_desc": w}, 32, 64)
    assert not M.weight_descriptors(cfg, {"wd_desc": w.float()}, 32, 64)
    assert not M.weight_descriptors(cfg, {"wd_desc": torch.randn(4, 40, 68).to(torch.bfloat16)[..., :60]}, 32, 64)
    assert M.weight_descriptors(cfg, {"wd_desc": w}, 32, 64).get("USE_TMA") is M.TMA


def test_row_tile_must_keep_the_mma_route():
    """A row entry with the tf32 route under a 16-bit-route decode entry would change bits: refused."""
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32")
    bad = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="tf32", block_m=32, min_rows=1)
    with M.MOE_CONFIGS.forced(lambda kernel, *f: bad if f[-1:] == ("rows",) else base):
        with pytest.raises(ValueError, match="route"):
            M._config("gate_up", ("fp8",), 4)


def test_fp8_row_entries_are_the_decode_tiles_in_row_programs():
    """FP8 has no row tiles (on an H200 every FP8 row tile changed a row's bits): its ("rows",) entries may
    differ from the decode entries in ``row_programs``, ``min_rows`` and the sub-tiles (``m_sub``,
    ``m_sub_pairs``) only -- the same tiles, so the same bits (test_row_programs_keep_every_pairs_bits,
    test_fp8_sub_tiles_keep_every_pairs_bits). Control: a 32-pair tile is caught."""
    free = ("row_programs", "min_rows", "m_sub", "m_sub_pairs")
    for kernel in ("gate_up", "down"):
        rows = M.MOE_CONFIGS.gpu.get((kernel, "fp8", "rows"))
        if rows is not None:
            decode = M.MOE_CONFIGS.gpu[(kernel, "fp8")]
            assert differs_only_in(rows, decode, free)
            assert not differs_only_in(dataclasses.replace(rows, block_m=32), decode, free)


def _few_entries_outside_free_fields(table: dict) -> list:
    """The few-rows entries (key + ("few", K)) of a GPU table that differ from their decode entry in a field
    outside :data:`~ds4t.kernels.moe.FEW_ROWS_FREE` (``max_rows`` aside): entries that would change bits."""
    bad = []
    for key, few in table.items():
        if isinstance(key, tuple) and "few" in key:
            decode = table[key[:key.index("few")] if len(key[:key.index("few")]) > 1 else key[0]]
            if not M.few_entry_keeps_bits(few, decode, key[0], "fp8" in key):
                bad.append(key)
    return bad


def test_gpu_few_rows_entries_change_only_free_fields():
    """Every few-rows entry of the GPU table differs from its decode entry only in the fields that keep a
    pair's bits (stages and scale blocks for FP8) and applies to some launch (max_rows >= 1) -- checked here
    on the CPU, where the interpreter never reads the GPU table; control: the same entry with a K split is
    caught."""
    table = dict(M.MOE_CONFIGS.gpu)
    few = {k: v for k, v in table.items() if isinstance(k, tuple) and "few" in k}
    assert few and all(v.max_rows >= 1 for v in few.values())
    assert _few_entries_outside_free_fields(table) == []
    key = next(iter(few))
    assert _few_entries_outside_free_fields({**table, key: dataclasses.replace(few[key], split=2)}) == [key]


def _row_programs_run(gu_rows, dn_rows, device, skipped=False):
    """moe_experts over 40 rows (3 hot routed experts of 7 with unchosen ones between, a shared expert
    holding every row: 2-7 row tiles of 16 pairs an expert) with the row entries' ``row_programs`` set
    per kernel; NaN-poisoned output. ``skipped``: every third row's first pair has expert -1 (another
    rank's, under expert parallel)."""
    E, I, D, k, B = 8, 72, 200, 2, 40
    wg, wu, wd = (w.to(device) for w in _weights(E, I, D, torch.bfloat16, 81))
    ids, w = _routing(B, 3, k, seed=82)
    ids = ids * 3                                   # experts 0, 3, 6; 1, 2, 4, 5 unchosen
    if skipped:
        ids[::3, 0] = -1
    ids, w = ids.to(device), w.to(device)
    h = torch.randn(B, D, generator=gen(83)).to(device)
    base = M.MoEConfig(tile_n=32, tile_k=64)
    rows = {kern: M.MoEConfig(tile_n=32, tile_k=64, block_m=16, min_rows=8, row_programs=on)
            for kern, on in (("gate_up", gu_rows), ("down", dn_rows))}
    with use_variants({"moe_experts": GPU}), \
            M.MOE_CONFIGS.forced(lambda kernel, *f: rows[kernel] if f[-1:] == ("rows",) else base):
        return moe_experts(h, ids, w, wg, wu, wd, shared_expert=E - 1, out=poisoned((B, D), device=device))


@pytest.mark.parametrize("gu_rows,dn_rows,skipped", [(True, True, False), (True, False, False), (False, True, False),
                                                     (True, True, True)])
def test_row_programs_keep_every_pairs_bits(device, gu_rows, dn_rows, skipped):
    """``MoEConfig.row_programs`` (one program per row tile instead of one per expert looping over its tiles;
    either kernel alone, or both) gives the per-expert programs' result bit for bit: the same pairs in the
    same tiles, pairs of another rank's experts (-1) in none. With only the gate/up kernel so, the down
    kernel finds its experts from ``bounds``."""
    want = _row_programs_run(False, False, device, skipped)
    got = _row_programs_run(gu_rows, dn_rows, device, skipped)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which only the interpreter looks up at call time")
def test_row_programs_control_a_lost_half_tile_is_caught(device, monkeypatch):
    """Negative control: row programs that each run half their tile leave pairs unwritten, and the
    comparison above catches it (the launcher's buffers start NaN: a freed buffer's old values could
    otherwise stand in for the unwritten ones)."""
    want = _row_programs_run(False, False, device)
    poison_empty(monkeypatch)
    monkeypatch.setattr(M, "_program_tile", half_row_tiles)
    assert not torch.equal(_row_programs_run(True, True, device), want)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=40), st.sampled_from([16, 32, 64]))
def test_row_program_count_bounds_the_tiles(counts, bm):
    """The launch's program count covers every row tile of any split of P pairs over E experts."""
    P = sum(counts)
    assert sum(triton.cdiv(c, bm) for c in counts) <= M.row_program_count(len(counts), P, bm)


# ----------------------------------------------------------------------------- few-rows entries (decode of 1-4 sessions)

_FEW_BASE = {"fp8": M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=True, num_warps=2, num_stages=3),
             # K tiles of 16: the down product's K (72) takes five steps, so a K split there changes sums
             "bf16": M.MoEConfig(tile_n=64, tile_k=16, num_warps=4, num_stages=3)}


def _few_rows_run(few_cfg, device, check=True, B=6, adt=torch.bfloat16, fmt="fp8"):
    """(B rows in one launch, each row alone) with the decode config of ``fmt`` weights (FP8, or bf16
    with fp32 activations) for B rows and ``few_cfg`` (a ("few", K) entry with max_rows 2) for the lone
    rows (FP8: the gate/up kernel's, bf16: both kernels'). ``check=False`` skips _config's field check (the
    negative control's way past it)."""
    E, I, D, k = 6, 72, 256, 2
    if fmt == "fp8":
        wg, wu, wd = (w.to(device) for w in _fp8_weights(E, I, D, 71))
    else:
        wg, wu, wd = (w.to(device) for w in _weights(E, I, D, torch.bfloat16, seed=71))
        adt = None
    ids, w = (t.to(device) for t in _routing(B, E - 1, k, seed=72))
    h = torch.randn(B, D, generator=gen(73)).to(device)
    base = _FEW_BASE[fmt]

    def rule(kernel, *f):
        if "few" in f:   # bf16: both kernels (its gate/up rounds silu(g)*u to bf16, which can hide an ulp)
            return few_cfg if f[-1] == D or fmt == "bf16" else None
        return None if "rows" in f else base

    def run(rows):
        with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(rule):
            return moe_experts(h[rows], ids[rows], w[rows], wg, wu, wd, shared_expert=E - 1,
                               act_dtype=adt, out=poisoned((h[rows].shape[0], D), device=device))

    real = M._config
    if not check:   # what _config would return without its check: the few entry whenever B fits
        def unchecked(kernel, fmt, n, K=0):
            f = M.MOE_CONFIGS(kernel, *fmt, "few", K)
            return f if f is not None and n <= f.max_rows else real(kernel, fmt, n, K)
        M._config = unchecked
    try:
        return run(slice(None)), torch.cat([run(slice(i, i + 1)) for i in range(B)])
    finally:
        M._config = real


def test_few_rows_entry_keeps_every_rows_bits(device):
    """A launch of <= max_rows rows runs the ("few", K) entry (here 6 pipeline stages instead of 3): each row
    alone equals that row in a 6-row launch (the decode entry), bitwise, on either backend, with bf16 and
    fp32 activations."""
    few = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=True, num_warps=2, num_stages=6, max_rows=2)
    for adt in (torch.bfloat16, torch.float32):
        full, alone = _few_rows_run(few, device, adt=adt)
        assert not torch.isnan(full).any() and torch.equal(full, alone)


def test_few_rows_control_a_split_k_is_caught(device):
    """Negative control: a few-rows entry that splits K in two (((a + b) + c) + d becomes (a + b) + (c + d)),
    let past the check, changes the lone rows, and the comparison above catches it."""
    bad = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=True, num_warps=2, num_stages=3, max_rows=2,
                      split=2)
    full, alone = _few_rows_run(bad, device, check=False, adt=torch.float32)   # (bf16 silu(g)*u hides an ulp)
    assert not torch.equal(full, alone)


def test_few_rows_bf16_entry_with_other_tiles_keeps_every_rows_bits(device):
    """16-bit weights: a few-rows entry may take other N tiles, warps and stages (FEW_ROWS_FREE); each lone
    row equals that row in the 6-row launch of the decode entry, bitwise. (The K tile is free on the GPU
    only: the interpreter's MMA sums each K tile before adding it, so this entry keeps it.)"""
    few = M.MoEConfig(tile_n=32, tile_k=16, num_warps=2, num_stages=4, max_rows=2)
    full, alone = _few_rows_run(few, device, fmt="bf16")
    assert not torch.isnan(full).any() and torch.equal(full, alone)


def test_few_rows_bf16_control_a_split_k_is_caught(device):
    """Negative control of the test above: the same comparison sees a few-rows entry that splits K."""
    bad = M.MoEConfig(tile_n=32, tile_k=16, num_warps=2, num_stages=4, max_rows=2, split=2)
    full, alone = _few_rows_run(bad, device, check=False, fmt="bf16")
    assert not torch.equal(full, alone)


@pytest.mark.parametrize("fmt", [("fp8",), ()])
def test_few_rows_entry_may_change_only_the_free_fields(fmt):
    """FP8: the stages alone; 16-bit weights: the stages, warps and N / K tiles (FEW_ROWS_FREE). Never the
    K split, the operand order or the route, in either format."""
    base = M.MoEConfig(tile_n=32, tile_k=64, fp8_route="f32", swap=True)
    ok = [dataclasses.replace(base, num_stages=8, max_rows=4)]
    bad = [dataclasses.replace(base, split=2, max_rows=4), dataclasses.replace(base, swap=False, max_rows=4),
           dataclasses.replace(base, fp8_route="tf32", max_rows=4)]
    tiles = [dataclasses.replace(base, tile_k=32, max_rows=4), dataclasses.replace(base, tile_n=64, max_rows=4),
             dataclasses.replace(base, num_warps=8, max_rows=4)]
    if fmt:
        bad += tiles
    else:
        ok += tiles
    for few in ok + bad:
        with M.MOE_CONFIGS.forced(lambda kernel, *f: few if "few" in f else None if "rows" in f else base):
            if few in bad:
                with pytest.raises(ValueError, match="may change num_stages"):
                    M._config("gate_up", fmt, 4, 256)
            else:
                assert M._config("gate_up", fmt, 4, 256) == few
                assert M._config("gate_up", fmt, 5, 256) == base   # past max_rows: the decode entry


# ----------------------------------------------------------------------------- unmasked loads of even shapes


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("swap", [False, True])
def test_even_shapes_drop_masks_not_bits(monkeypatch, fmt, swap):
    """Expert shapes that are whole numbers of loop steps and N tiles (every real one) load weights, scales
    and activations unmasked (``moe.evenness``): the grouped kernels give the bits of the masked launch,
    at the GPU table's tiles (swapped or not) and the interpreter's. Control: the evenness test itself --
    a ragged shape must not be called even; and one weight of the shared expert one ulp away is seen by
    the same comparison."""
    B, E, k, D, I = 5, 6, 2, 256, 128
    assert M.evenness(D, 128, I, 32) == dict(EVEN_K=True, EVEN_N=True)
    assert M.evenness(300, 128, 136, 32) == dict(EVEN_K=False, EVEN_N=False)
    if fmt == "fp8":
        wg, wu, wd = _fp8_weights(E, I, D, seed=3)
        h = torch.randn(B, D, generator=gen(4)).to(torch.bfloat16)
        gu_cfg = M.MoEConfig(tile_n=32, tile_k=128, num_warps=2, num_stages=3, fp8_route="f32", swap=swap)
        dn_cfg = M.MoEConfig(tile_n=128, tile_k=128, num_warps=2, num_stages=3, fp8_route="f32", swap=swap)
    else:
        wg, wu, wd = _weights(E, I, D, torch.bfloat16, seed=3)
        h = torch.randn(B, D, generator=gen(4))
        gu_cfg = M.MoEConfig(tile_n=64, tile_k=64, swap=swap)
        dn_cfg = M.MoEConfig(tile_n=128, tile_k=64, swap=swap)
    ids, w = _routing(B, E, k, seed=5)
    dev = h.device if h.device.type != "cpu" else None
    args = [t.to(dev) if dev is not None and isinstance(t, torch.Tensor) else t for t in (h, ids, w)]
    rule = lambda kernel, *fmt_: None if fmt_[-1:] == ("rows",) else (gu_cfg if kernel == "gate_up" else dn_cfg)  # noqa: E731
    with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(rule):
        even = moe_experts(*args, wg, wu, wd, shared_expert=E - 1)
        monkeypatch.setattr(M, "evenness", lambda K, step, N, BN: dict(EVEN_K=False, EVEN_N=False))
        masked = moe_experts(*args, wg, wu, wd, shared_expert=E - 1)
    assert not torch.isnan(even).any()
    assert torch.equal(even, masked)
    bits = wd.data if fmt == "fp8" else wd
    raw = bits.view(torch.uint8 if fmt == "fp8" else torch.int16)
    raw[E - 1, 0, 0] ^= 1                                    # one ulp of one shared-expert weight
    with use_variants({"moe_experts": GPU}), M.MOE_CONFIGS.forced(rule):
        assert not torch.equal(moe_experts(*args, wg, wu, wd, shared_expert=E - 1), even)
