import pytest
import torch
import triton
import triton.language as tl

from ds4t import backend
from ds4t.backend import cast, mma
from ds4t.kernels.quant_blocks import bf16_of_f64


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = mma(a, b, tl.zeros((M, N), tl.float32))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r, mask=r < n)
    tl.store(y_ptr + r, cast(x, y_ptr.dtype.element_ty), mask=r < n)


@triton.jit
def _pair_sum_kernel(x_ptr, y_ptr, t_ptr, M: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :])
    tl.store(y_ptr + rm, backend.pair_sum(x))
    tl.store(t_ptr + rm, tl.sum(x, axis=1))
    x3 = tl.reshape(x, (M, 2, N // 2))   # the same rows as two halves: pair_sum of each half, [M, 2]
    tl.store(y_ptr + M + rm[:, None] * 2 + tl.arange(0, 2)[None, :], backend.pair_sum(x3))


def _tree_ref(x: torch.Tensor) -> torch.Tensor:
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


@pytest.mark.parametrize("warps", [1, 4, 8])
def test_pair_sum_is_one_tree_in_any_layout(device, warps):
    """pair_sum adds adjacent pairs, log2(n) times: bitwise the torch reference of that tree whatever the
    warps (the layout), on any rank; the sum over a row is the sum of its halves' sums. Control: the same
    rows summed in another order (left to right; on the GPU also tl.sum) round differently, so the
    comparison can fail."""
    g = torch.Generator().manual_seed(3)
    M, N = 8, 2048
    x = (torch.randn(M, N, generator=g) * torch.logspace(-3, 3, N)[torch.randperm(N, generator=g)]).to(device)
    y = torch.full((M + 2 * M,), float("nan"), device=device)
    t = torch.full((M,), float("nan"), device=device)
    _pair_sum_kernel[(1,)](x, y, t, M, N, num_warps=warps)
    ref = _tree_ref(x.cpu())
    assert torch.equal(y[:M].cpu(), ref)
    halves = _tree_ref(x.cpu().view(M, 2, N // 2))
    assert torch.equal(y[M:].cpu().view(M, 2), halves) and torch.equal(halves[:, 0] + halves[:, 1], ref)
    seq = x.cpu()[:, 0].clone()
    for i in range(1, N):
        seq += x.cpu()[:, i]
    assert not torch.equal(seq, ref)   # the control: another order, other bits
    if device != "cpu":
        assert not torch.equal(t.cpu(), ref)   # tl.sum's order is the layout's, not this tree


def test_bf16_dot_matches_torch(device):
    a = torch.randn(16, 32, device=device).bfloat16()
    b = torch.randn(32, 16, device=device).bfloat16()
    c = torch.full((16, 16), float("nan"), device=device)
    _dot_kernel[(1,)](a, b, c, 16, 32, 16)
    ref = a.float() @ b.float()
    torch.testing.assert_close(c, ref, rtol=1e-5, atol=1e-4)


def test_fp32_dot_is_ieee_not_tf32(device):
    a = torch.randn(16, 64, device=device, dtype=torch.float64).float()
    b = torch.randn(64, 16, device=device, dtype=torch.float64).float()
    c = torch.full((16, 16), float("nan"), device=device)
    _dot_kernel[(1,)](a, b, c, 16, 64, 16)
    ref = (a.double() @ b.double()).float()
    torch.testing.assert_close(c, ref, rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_rounds_to_nearest_even(device):
    # values chosen on and around bf16 rounding boundaries, plus specials
    base = torch.randn(1000, device=device)
    bits = base.view(torch.int32)
    halfway = (bits & ~0xFFFF) | 0x8000  # exact ties
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4e38], device=device)
    x = torch.cat([base, halfway.view(torch.float32), specials])
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](x, y, x.numel(), triton.next_power_of_2(x.numel()))
    assert torch.equal(y, x.to(torch.bfloat16))


def test_backend_matches_device():
    assert backend.INTERPRET == (not torch.cuda.is_available())
    assert backend.default_device().type == ("cpu" if backend.INTERPRET else "cuda")


def test_timer_returns_positive_ms(device):
    x = torch.randn(1000, device=device)
    assert backend.timer(lambda: x.sum(), warmup=1, iters=3) > 0


@triton.jit
def _dot_rows_kernel(a_ptr, b_ptr, c_ptr, K: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, 16)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], mma(a, b, tl.zeros((16, N), tl.float32)))


def test_mma_row_bits_do_not_depend_on_the_row_slot(device):
    """The same row placed in each of the 16 tile rows gives the same bits (BLAS panels don't)."""
    row = torch.randn(1, 128, device=device)
    b = torch.randn(128, 32, device=device)
    a = torch.randn(16, 128, device=device)
    outs = []
    for slot in range(16):
        a2 = a.clone()
        a2[slot] = row
        c = torch.full((16, 32), float("nan"), device=device)
        _dot_rows_kernel[(1,)](a2, b, c, 128, 32)
        outs.append(c[slot])
    assert all(torch.equal(outs[0], o) for o in outs)


@triton.jit
def _scalar_mask_kernel(x_ptr, n_ptr, y_ptr, BLOCK: tl.constexpr):
    # every row of the loop reads lanes < 3 while its row index t + 1 < n (a runtime scalar)
    n = tl.load(n_ptr).to(tl.int64)
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for t in range(4):
        acc += tl.load(x_ptr + t * BLOCK + r, mask=tl.where(t + 1 < n, r < 3, False), other=0.0)
    tl.store(y_ptr + r, acc)


def test_a_scalar_condition_masks_through_where(device):
    """The interpreter rejects ``mask & (t < n)`` as a load mask (docs/design.md); kernels write
    ``tl.where(t < n, mask, False)``, which both backends take and mean the same."""
    x = torch.arange(16, dtype=torch.float32, device=device).view(4, 4) + 1
    for n in (0, 2, 4):
        y = torch.full((4,), float("nan"), device=device)
        _scalar_mask_kernel[(1,)](x, torch.tensor([n], device=device), y, BLOCK=4)
        want = x[:max(n - 1, 0)].sum(0)
        want[3] = 0
        assert torch.equal(y, want), n


@triton.jit
def _small_ints_kernel(a_ptr, b_ptr, out_ptr, KIND: tl.constexpr, NIB: tl.constexpr, PAIR: tl.constexpr,
                       DT: tl.constexpr):
    r = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    a = tl.load(a_ptr + r)
    if KIND == 0:
        lo, hi = backend.nibbles_to(a, DT)
        tl.store(out_ptr + r, lo.to(tl.float32))
        tl.store(out_ptr + 256 + r, hi.to(tl.float32))
    elif KIND == 1:
        tl.store(out_ptr + r, backend.int8_to(a, DT).to(tl.float32))
    else:
        tl.store(out_ptr + r, backend.six_bit_to(a, tl.load(b_ptr + r), NIB, PAIR, DT).to(tl.float32))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
def test_packed_small_int_conversions_are_exact(device, dt):
    """The GGUF kernels' byte -> float conversions (packed bit tricks for bf16 on the GPU, plain
    conversions otherwise) give every byte's exact integer: nibbles, int8, and Q6_K's six bits for
    every (nibble, bit pair) choice. A wrong shift, mask or magic constant fails here, not as a
    small drift in a kernel's result."""
    tdt = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]
    a = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    b = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.uint8).to(device)
    out = torch.full((512,), float("nan"), device=device)
    _small_ints_kernel[(1,)](a, b, out, KIND=0, NIB=0, PAIR=0, DT=tdt)
    ai = a.long()
    assert torch.equal(out[:256].long(), ai & 15) and torch.equal(out[256:].long(), ai >> 4)
    _small_ints_kernel[(1,)](a, b, out, KIND=1, NIB=0, PAIR=0, DT=tdt)
    assert torch.equal(out[:256], a.view(torch.int8).float())
    for nib in range(2):
        for pair in range(4):
            _small_ints_kernel[(1,)](a, b, out, KIND=2, NIB=nib, PAIR=pair, DT=tdt)
            ref = (((ai >> (4 * nib)) & 15) | (((b.long() >> (2 * pair)) & 3) << 4)) - 32
            assert torch.equal(out[:256], ref.float()), (nib, pair)


@triton.jit
def _pieces_kernel(x_ptr, out_ptr, inv_ptr, M: tl.constexpr, K: tl.constexpr):
    r = tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :]
    x1, x2, inv = backend.fp8_pieces(tl.load(x_ptr + r))
    tl.store(out_ptr + r, x1.to(tl.float32))
    tl.store(out_ptr + M * K + r, x2.to(tl.float32))
    tl.store(inv_ptr + tl.arange(0, M), inv)


def _pieces(x):
    M, K = x.shape
    out = torch.full((2, M, K), float("nan"), device=x.device)
    inv = torch.full((M,), float("nan"), device=x.device)
    _pieces_kernel[(1,)](x, out, inv, M, K)
    return out[0], out[1], inv


def test_fp8_pieces_rebuild_each_row(device):
    """FP8 route "x2" splits each row of a bf16 tile into two fp8 pieces times a power of two: exact for
    every element of at least 2^-9 of its row's largest, within 2^-17 of that largest below, whatever
    the row's magnitude (1e-30 .. 1e30, a zero row); a row's pieces do not depend on the other rows."""
    g = torch.Generator().manual_seed(3)
    mags = torch.tensor([1.0, 1e-30, 1e30, 3.0, 0.0, 1e-3, 7e4, 0.5, 2.0, 1e5, 1e-8, 1.0, 1.0, 1.0, 1.0, 1.0])
    x = torch.randn(16, 64, generator=g) * mags[:, None]
    x[11] = torch.randn(64, generator=g) * torch.logspace(0, -12, 64)   # one row of mixed magnitudes
    x = x.bfloat16().float().to(device)
    x1, x2, inv = _pieces(x)
    assert torch.all(inv > 0) and torch.equal(torch.frexp(inv)[0], torch.full_like(inv, 0.5))   # powers of two
    rebuilt = (x1 + x2) * inv[:, None]
    amax = x.abs().amax(dim=1, keepdim=True)
    big = x.abs() >= amax * 2.0 ** -9
    assert torch.equal(rebuilt[big], x[big])
    assert torch.all((rebuilt - x).abs() <= amax * 2.0 ** -17)
    assert (rebuilt != x).any()   # control: row 11's smallest elements do lose bits
    # row 0 alone (in a tile of copies of row 5) gets the pieces it gets among the others
    y = x[[5] * 16].clone()
    y[0] = x[0]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_pieces(y), (x1, x2, inv)))


def test_fp8_route_x2_needs_bf16():
    assert backend.fp8_route("t", "x2", torch.bfloat16) == backend.FP8_ROUTES["x2"]
    for dt in (torch.float16, torch.float32):
        with pytest.raises(ValueError, match="x2"):
            backend.fp8_route("t", "x2", dt)


@triton.jit
def _f16_rows_kernel(x_ptr, out_ptr, inv_ptr, M: tl.constexpr, K: tl.constexpr):
    r = tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :]
    x16, inv = backend.f16_rows(tl.load(x_ptr + r))
    tl.store(out_ptr + r, x16.to(tl.float32))
    tl.store(inv_ptr + tl.arange(0, M), inv)


def test_f16_rows_rebuild_each_row(device):
    """FP8 route "f16" scales each row of a bf16 tile by a power of two into fp16: exact for every element of
    at least 2^-31 of its row's largest (every element of these rows but row 11's tail), within 2^-39 of that
    largest below, for rows of any magnitude and a zero row; a row's values do not depend on the others."""
    g = torch.Generator().manual_seed(4)
    mags = torch.tensor([1.0, 1e-30, 1e30, 3.0, 0.0, 1e-3, 7e4, 0.5, 2.0, 1e5, 1e-8, 1.0, 6e4, 1.0, 1.0, 1.0])
    x = torch.randn(16, 64, generator=g) * mags[:, None]
    x[11] = torch.randn(64, generator=g) * torch.logspace(0, -14, 64)   # down to 1e-14 of the largest
    x = x.bfloat16().float().to(device)
    M, K = x.shape
    out = torch.full((M, K), float("nan"), device=device)
    inv = torch.full((M,), float("nan"), device=device)
    _f16_rows_kernel[(1,)](x, out, inv, M, K)
    assert torch.all(inv > 0) and torch.equal(torch.frexp(inv)[0], torch.full_like(inv, 0.5))
    rebuilt = out * inv[:, None]
    amax = x.abs().amax(dim=1, keepdim=True)
    big = x.abs() >= amax * 2.0 ** -31
    assert torch.equal(rebuilt[big], x[big])
    assert torch.all((rebuilt - x).abs() <= amax * 2.0 ** -39)
    assert (rebuilt != x).any() and not big[11].all()   # control: row 11's tail does lose bits
    assert torch.all(out.abs() < 2.0 ** 15)
    y = x[[5] * 16].clone()
    y[0] = x[0]
    out_y, inv_y = torch.empty_like(out), torch.empty_like(inv)
    _f16_rows_kernel[(1,)](y, out_y, inv_y, M, K)
    assert torch.equal(out_y[0], out[0]) and inv_y[0] == inv[0]


def test_fp8_route_f16_needs_16_bit_activations():
    for dt in (torch.bfloat16, torch.float16):
        assert backend.fp8_route("t", "f16", dt) == backend.FP8_ROUTES["f16"]
    with pytest.raises(ValueError, match="f16"):
        backend.fp8_route("t", "f16", torch.float32)


@triton.jit
def _fma_bf16_kernel(a_ptr, b_ptr, c_ptr, o_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r)
    b = tl.load(b_ptr + r)
    c = tl.load(c_ptr + r)
    tl.store(o_ptr + r, backend.fma_bf16(a, b, c))


def test_fma_bf16_rounds_once(device):
    """a * b + c rounded once to bf16 (the GGUF fold route's weights): against an fp64 reference rounded
    from its bits, with products whose exact sum sits on or next to a bf16 tie (two roundings -- fp32, then
    bf16 -- would break those) and c = -0 / large cancellations."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-64, 64, (4096,), generator=g).double()
    b = (torch.randn(4096, generator=g).double() * 2.0 ** torch.randint(-12, 4, (4096,), generator=g)).float()
    b = b.bfloat16().double()
    c = -(a * b).float().bfloat16().double() * torch.randint(0, 2, (4096,), generator=g)   # cancellations
    c[:512] = (a[:512] * b[:512]) * 2.0 ** -9   # near-ties: a*b + c lands between bf16 neighbours
    # 5 * 77/256 = 1.10000001b, a bf16 tie that RNE rounds down; + 2^-30 must round it up, but fp32 first
    # rounds the sum back onto the tie
    a[:8], b[:8], c[:8] = 5.0, 77 / 256, 2.0 ** -30
    a[4:8] = -5.0
    a16, b16, c16 = (t.float().bfloat16() for t in (a, b, c))
    ref = bf16_of_f64(a16.double() * b16.double() + c16.double())   # exact in fp64, rounded once
    out = torch.empty(4096, dtype=torch.bfloat16, device=device)
    _fma_bf16_kernel[(1,)](a16.to(device), b16.to(device), c16.to(device), out, BLOCK=4096)
    assert torch.equal(out.cpu(), ref)
    assert not torch.equal(ref, (a16.float() * b16.float() + c16.float()).bfloat16())   # the control: 2 roundings differ


@pytest.mark.skipif(not backend.INTERPRET, reason="an interpreter work-around")
def test_memoized_np_dtype_answers_as_triton_does():
    # ds4t.backend._memoize_np_dtype: the table must give Triton's own answer for every element type,
    # pointer and block type (a wrong dtype would reinterpret loaded bytes).
    from triton.runtime import interpreter as interp

    fast = interp._get_np_dtype
    assert getattr(fast, "_ds4t_memo", False)
    slow = fast._ds4t_original
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv, tl.float8e5]
    types = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4, 8]) for t in scalars]
    types += [tl.block_type(tl.pointer_type(t), [16]) for t in scalars]
    for _ in range(2):                          # the second pass answers from the table
        for t in types:
            assert fast(t) == slow(t), t


@pytest.mark.skipif(not backend.INTERPRET, reason="an interpreter work-around")
def test_reused_block_types_and_tensors_equal_tritons_own():
    # ds4t.backend._reuse_block_types: a block type / tensor built from the kept attributes equals the one
    # Triton's constructors build, the second time as the first; invalid shapes still raise.
    from triton.language import core

    new_bt, new_t = core.block_type.__init__, core.tensor.__init__
    assert getattr(new_bt, "_ds4t_reuse", False)
    old_bt, old_t = new_bt._ds4t_original, new_t._ds4t_original

    def same_shape(x, y):       # Triton's shapes are tl.tuple (a values list and a tuple_type)
        def dims(t):
            return [getattr(d, "value", d) for d in t.values]
        return type(x) is type(y) is core.tuple and dims(x) == dims(y) and x.type == y.type

    def build(init, *args, cls=core.block_type):
        obj = cls.__new__(cls)
        init(obj, *args)
        return obj

    for _ in range(2):
        for ety in (tl.float32, tl.bfloat16, tl.pointer_type(tl.float32), tl.int1):
            for shape in ([16], [4, 8], [2, 4, 8], [core.constexpr(8), 2], core.tuple([2, 8])):
                a, b = build(new_bt, ety, shape), build(old_bt, ety, shape)
                assert (a.element_ty, a.numel, a.name) == (b.element_ty, b.numel, b.name)
                assert same_shape(a.shape, b.shape) and a == b and str(a) == str(b)
                ta, tb = build(new_t, None, a, cls=core.tensor), build(old_t, None, b, cls=core.tensor)
                assert (ta.type, ta.dtype, ta.numel.value) == (tb.type, tb.dtype, tb.numel.value)
                assert same_shape(ta.shape, tb.shape) and ta.shape + [1] == tb.shape + [1]
            scalar_a, scalar_b = build(new_t, None, ety, cls=core.tensor), build(old_t, None, ety, cls=core.tensor)
            assert same_shape(scalar_a.shape, scalar_b.shape) and scalar_a.numel.value == scalar_b.numel.value == 1
        two = [build(new_bt, tl.float32, [4, 8]) for _ in range(2)]
        assert two[0].shape is not two[1].shape and two[0].shape.values is not two[1].shape.values
        for bad in ([3], [16, 6]):
            with pytest.raises(ValueError, match="power of 2"):
                build(new_bt, tl.float32, bad)
        with pytest.raises(AssertionError):        # Triton's own check: a builtin tuple is not a shape
            build(new_bt, tl.float32, (2, 4))


@pytest.mark.skipif(not backend.INTERPRET, reason="an interpreter work-around")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_gathered_loads_equal_tritons_own(dtype):
    # ds4t.backend._gather_loads: every lane gets the bytes Triton's own load gives it, in its memory order --
    # whole, masked with and without `other`, transposed, repeated (stride 0), F-ordered pointer arrays and
    # misaligned addresses.
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    new = interp.InterpreterBuilder.create_masked_load
    assert getattr(new, "_ds4t_gather", False)
    old = new._ds4t_original
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(64, 48, generator=g) * 8).to(dtype)
    ety = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.int8: tl.int8, torch.bool: tl.int1,
           torch.float8_e4m3fn: tl.float8e4nv}[dtype]
    size, base = src.element_size(), src.data_ptr()
    rows, cols = np.arange(32)[:, None], np.arange(16)[None, :]
    grids = {"whole": rows * 48 + cols, "transposed": cols * 48 + rows, "repeated": 0 * rows + cols,
             "row tile": (rows + 30) * 48 + cols, "pointers in F order": np.asfortranarray(rows * 48 + cols)}
    masks = {"all": np.ones((32, 16), bool), "some": (rows + cols) % 3 > 0, "none": np.zeros((32, 16), bool)}
    b = interp.interpreter_builder
    np_dt = interp._get_np_dtype(ety)
    for gname, grid in grids.items():
        ptrs = interp.TensorHandle((base + grid * size).astype(np.uint64), tl.pointer_type(ety))
        for mname, m in masks.items():
            mask = interp.TensorHandle(m, tl.int1)
            for other in (None, interp.TensorHandle(np.full((32, 16), 1, dtype=np_dt), ety)):
                a, w = new(b, ptrs, mask, other, None, False), old(b, ptrs, mask, other, None, False)
                assert a.data.dtype == w.data.dtype and a.dtype == w.dtype, (gname, mname)
                # the layout too: the interpreter's reductions (mma's K sum) follow it
                assert a.data.strides == w.data.strides, (gname, mname)
                assert np.array_equal(a.data.view(np.uint8), w.data.view(np.uint8)), (gname, mname)
    if size > 1:     # misaligned addresses (one byte off), and addresses not whole elements apart: the same bytes
        mask = interp.TensorHandle(masks["all"], tl.int1)
        for addr in (base + 1 + grids["whole"] * size, base + grids["whole"] * size + grids["whole"] % 2):
            ptrs = interp.TensorHandle(addr.astype(np.uint64), tl.pointer_type(ety))
            a, w = new(b, ptrs, mask, None, None, False), old(b, ptrs, mask, None, None, False)
            assert a.data.strides == w.data.strides
            assert np.array_equal(a.data.view(np.uint8), w.data.view(np.uint8))


@triton.jit
def _to_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r, mask=r < n)
    tl.store(y_ptr + r, x.to(y_ptr.dtype.element_ty), mask=r < n)


@pytest.mark.skipif(not backend.PATCH_INTERPRETER, reason="an interpreter work-around (DS4T_INTERPRETER_REPATCH=1: off)")
def test_fast_float_conversions_equal_tritons_own():
    # ds4t.backend._fast_float_conversions: every conversion from a 16- or 8-bit float for every bit pattern, and
    # fp32 -> bf16 (truncating, as Triton's own) for every top half beside low halves at the rounding edges and for
    # subnormal, zero, Inf and NaN words, give Triton's own function's bits.
    import numpy as np
    from triton.runtime import interpreter as interp

    fast = interp._convert_float
    assert getattr(fast, "_ds4t_fast", False)
    own = fast._ds4t_original
    from triton._C.libtriton import ir

    rtne = ir.ROUNDING_MODE.RTNE
    pairs = [(tl.bfloat16, tl.float32, None), (tl.float8e4nv, tl.float32, None), (tl.float8e4nv, tl.float16, None),
             (tl.float8e4nv, tl.bfloat16, None), (tl.float8e5, tl.float32, None), (tl.float8e5, tl.bfloat16, None),
             (tl.bfloat16, tl.float8e4nv, rtne), (tl.float16, tl.float8e4nv, rtne), (tl.bfloat16, tl.float8e5, rtne)]
    for src, dst, rounding in pairs:
        width = src.primitive_bitwidth
        codes = np.arange(1 << width, dtype=f"uint{width}").reshape(-1, 1 << (width // 2))   # any shape
        a, w = fast(codes, src, dst, rounding), own(codes, src, dst, rounding)
        assert a.dtype == w.dtype and a.shape == w.shape and np.array_equal(a, w), (src, dst)
    tops = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xBEEF], dtype=np.uint32)
    words = (tops[:, None] | lows[None, :]).reshape(-1)
    words = np.concatenate([words, np.arange(1, 1 << 16, dtype=np.uint32) * np.uint32(97) % np.uint32(1 << 23)])
    a, w = fast(words.view(np.float32), tl.float32, tl.bfloat16, None), own(words.view(np.float32), tl.float32,
                                                                            tl.bfloat16, None)
    assert a.dtype == w.dtype and np.array_equal(a, w)


@pytest.mark.skipif(not backend.PATCH_INTERPRETER, reason="an interpreter work-around (DS4T_INTERPRETER_REPATCH=1: off)")
def test_plain_to_bf16_rounds_to_nearest_even_as_cast_did(device):
    # `.to(tl.bfloat16)` of fp32 in the interpreter rounds as the GPU does: torch's bits for finite values (ties to
    # even), Inf and NaN kept; the bits the integer-op rounding of ds4t.backend.cast gave. Control: Triton's own
    # truncating conversion differs on these values.
    import numpy as np

    g = torch.Generator().manual_seed(3)
    base = torch.randn(1000, generator=g)
    halfway = ((base.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, 1e-40, -3e-39])
    x = torch.cat([base, halfway, specials])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _to_kernel[(1,)](x, y, x.numel(), triton.next_power_of_2(x.numel()))
    normal = torch.isfinite(x) & (x.abs() >= torch.finfo(torch.float32).tiny)
    assert torch.equal(y[normal], x[normal].to(torch.bfloat16))
    assert torch.isnan(y[x.isnan()]).all() and torch.equal(y[x.isinf()], x[x.isinf()].to(torch.bfloat16))
    # every word, subnormals too: ds4t.backend.round_bf16_in_f32's integer rounding, then Triton's own truncation
    from triton.runtime import interpreter as interp
    own = interp._convert_float._ds4t_original
    bits = x.view(torch.int32).numpy().view(np.uint32)
    bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    kept = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    rounded = np.where(kept, bits, bits + bias) & np.uint32(0xFFFF0000)
    assert np.array_equal(y.view(torch.int16).numpy().view(np.uint16), own(rounded.view(np.float32), tl.float32,
                                                                            tl.bfloat16, None))
    truncated = own(x.numpy(), tl.float32, tl.bfloat16, None)   # the control: Triton's own .to() differs
    assert not np.array_equal(truncated, y.view(torch.int16).numpy().view(np.uint16))


def test_packed_asm_gives_the_interpreters_values():
    """The GPU's packed bit tricks (PTX strings the interpreter never runs), emulated instruction by
    instruction: each gives the value the interpreter's formula gives, for every byte in every lane (int8,
    nibbles and signed nibbles exhaustively; Q5_K's five bits and Q6_K's six bits (two and four bytes a call) on
    random bytes at every bit position). Controls: asms with a wrong shift are caught."""
    import numpy as np

    from ds4t import backend as B
    from tests.ptx_emulator import lanes, run

    def packed(bs):   # bytes, lowest first, as one register
        return sum(b << (8 * i) for i, b in enumerate(bs))

    for b0 in range(256):   # int8_to: four bytes -> four values
        word = b0 | (((b0 * 7) & 255) << 8) | (((b0 * 13) & 255) << 16) | (((b0 * 29) & 255) << 24)
        out = run(B._INT8_BF16_ASM.value, {2: word})
        got = [*lanes(out["$0"]), *lanes(out["$1"])]
        assert got == [((word >> (8 * i)) & 255 ^ 128) - 128 for i in range(4)], hex(word)
    for off in (0, 8):      # nibbles_to (Q4_K) and its signed form (Q4_0), two and four bytes a call
        two, four = B._nibbles_asm(off, 2), B._nibbles_asm(off, 4)
        for b0 in range(256):
            bs = [b0, b0 ^ 0x5A, (b0 * 7) & 255, (b0 * 29 + 3) & 255]
            out = run(two, {2: bs[0] | (bs[1] << 8)})
            assert list(lanes(out["$0"])) == [(b & 15) - off for b in bs[:2]]
            assert list(lanes(out["$1"])) == [(b >> 4) - off for b in bs[:2]]
            out = run(four, {4: packed(bs)})
            assert [*lanes(out["$0"]), *lanes(out["$1"])] == [(b & 15) - off for b in bs]
            assert [*lanes(out["$2"]), *lanes(out["$3"])] == [(b >> 4) - off for b in bs]
    rng = np.random.default_rng(0)

    def five_bits_ok(asm, bit, n=200):
        for q0, q1, h0, h1 in rng.integers(0, 256, (n, 4)).tolist():
            out = run(asm, {2: q0 | (q1 << 8), 3: h0 | (h1 << 8)})
            want_lo = [(q & 15) | (((h >> bit) & 1) << 4) for q, h in ((q0, h0), (q1, h1))]
            want_hi = [(q >> 4) | (((h >> (bit + 1)) & 1) << 4) for q, h in ((q0, h0), (q1, h1))]
            if list(lanes(out["$0"])) != want_lo or list(lanes(out["$1"])) != want_hi:
                return False
        return True

    for bit in range(7):
        assert five_bits_ok(B._FIVE_BITS_ASMS.value[bit], bit), bit
    assert not five_bits_ok(B._five_bits_asm(3), 2)   # control: the asm of another bit position
    def six_bits_ok(asm, nib, pair, pack, n=100):
        for row in rng.integers(0, 256, (n, 2 * pack)).tolist():
            qs, hs = row[:pack], row[pack:]
            out = run(asm, {1: packed(qs), 2: packed(hs)} if pack == 2 else {2: packed(qs), 3: packed(hs)})
            got = [v for i in range(pack // 2) for v in lanes(out[f"${i}"])]
            if got != [(((q >> (4 * nib)) & 15) | (((h >> (2 * pair)) & 3) << 4)) - 32 for q, h in zip(qs, hs)]:
                return False
        return True

    for pack in (2, 4):   # six_bit_to (Q6_K), two and four bytes of each input a call
        for nib in range(2):
            for pair in range(4):
                assert six_bits_ok(B._SIX_BIT_ASMS.value[8 * (pack == 4) + 4 * nib + pair], nib, pair, pack)
        assert not six_bits_ok(B._six_bit_asm(0, 1, pack), 0, 0, pack)   # control: another bit pair


@triton.jit
def _binary_ops_kernel(x_ptr, h_ptr, i_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :])          # fp32 [M, N]: pointer + int broadcast
    h = tl.load(h_ptr + rn)                                      # fp16 [N]
    i = tl.load(i_ptr + rm)                                      # int32 [M]
    a = x + h[None, :]                                           # mixed types: Triton's promotion
    b = a * x                                                    # one type, one shape
    c = b - tl.load(x_ptr + rm[:, None] * N)                     # one type, [M, 1] broadcast against [M, N]
    d = (h / h)[None, :] + (h % h)[None, :]                      # fp16 division and modulo: promoted to fp32
    e = (i[:, None] * 3 + rn[None, :]) % 5                       # int32: broadcast both ways, scalar constants
    f = tl.where(e > 2, c, d) + e                                # int32 into fp32
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], f)


@pytest.mark.skipif(not backend.PATCH_INTERPRETER, reason="an interpreter work-around (DS4T_INTERPRETER_REPATCH=1: off)")
def test_fast_binary_semantics_give_tritons_own_results(monkeypatch):
    # ds4t.backend._fast_binary_semantics / _fast_constexpr_unwrap: a kernel of same-type, mixed-type, broadcast,
    # pointer and promoted (fp16 division) binary ops gives the same bits with Triton's own functions put back.
    # Control: a broadcast that hands back its operands swapped (what a wrong fast path could do to a subtraction)
    # is caught by the same comparison.
    from triton.language import core
    from triton.runtime import interpreter as interp

    semantic = type(interp.interpreter_semantic)
    fast_check, fast_broadcast = semantic.binary_op_type_checking_impl, semantic.broadcast_impl_value
    assert getattr(fast_check, "_ds4t_fast", False) and getattr(core._unwrap_if_constexpr, "_ds4t_fast", False)
    g = torch.Generator().manual_seed(5)
    M, N = 4, 8
    x = torch.randn(M, N, generator=g)
    h = (torch.rand(N, generator=g) * 3 + 0.5).half()
    i = torch.randint(-7, 7, (M,), generator=g, dtype=torch.int32)

    def run():
        out = torch.full((M, N), float("nan"))
        _binary_ops_kernel[(1,)](x, h, i, out, M, N)
        return out

    hits = {"check": 0, "broadcast": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            hits[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(semantic, "binary_op_type_checking_impl", counting("check", fast_check))
    monkeypatch.setattr(semantic, "broadcast_impl_value", counting("broadcast", fast_broadcast))
    fast = run()
    assert hits["check"] > 10 and hits["broadcast"] > 10 and not torch.isnan(fast).any()
    monkeypatch.setattr(semantic, "binary_op_type_checking_impl", fast_check._ds4t_original)
    monkeypatch.setattr(semantic, "broadcast_impl_value", fast_broadcast._ds4t_original)
    monkeypatch.setattr(core, "_unwrap_if_constexpr", core._unwrap_if_constexpr._ds4t_original)
    own = run()
    assert torch.equal(fast, own)

    def swapped(self, lhs, rhs):
        left, right = fast_broadcast._ds4t_original(self, lhs, rhs)
        return (right, left) if left.dtype.is_floating() and right.dtype.is_floating() else (left, right)

    monkeypatch.setattr(semantic, "broadcast_impl_value", swapped)
    assert not torch.equal(run(), own)


@triton.jit
def _builtin_calls_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r, mask=r < n, other=-1.0)               # keyword arguments through the stand-in
    y = tl.maximum(x, 0.25) - tl.sum(x, axis=0) / BLOCK           # a tl function, a reduction with a keyword
    z = tl.where(r % 3 == 0, tl.exp(y), y * x).to(tl.bfloat16)    # tl.math, a method, a conversion
    tl.store(out_ptr + r, z.to(tl.float32), mask=r < BLOCK)


@pytest.mark.skipif(not backend.PATCH_INTERPRETER, reason="an interpreter work-around (DS4T_INTERPRETER_REPATCH=1: off)")
def test_direct_builtin_calls_give_tritons_own_results():
    # ds4t.backend._direct_builtin_calls: with its stand-ins for the tl builtins (positional and keyword arguments,
    # tl functions, tensor methods and operators, tl.math) a kernel gives the bits it gives with Triton's own
    # stand-ins patched back in. Control: a stand-in that loses one keyword argument (``other``: the masked lanes
    # read 0 instead of -1) is caught by the same comparison.
    from triton.language import core
    from triton.runtime import interpreter as interp

    patch_attr = interp._patch_attr
    assert getattr(patch_attr, "_ds4t_direct", False)
    n, BLOCK = 13, 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(7))

    def run():
        out = torch.full((BLOCK,), float("nan"))
        _builtin_calls_kernel[(1,)](x, out, n, BLOCK=BLOCK)
        return out

    ours = run()
    assert core.tensor.__add__.__qualname__.endswith("stand_in") and not torch.isnan(ours).any()

    def patched_with(attr):
        """The kernel's result with tl / tl.core patched afresh by ``attr``; ds4t's stand-ins come back at the next
        launch (the patching is undone and forgotten before and after)."""
        scopes = interp._patch_lang._ds4t_scopes

        def unpatch():
            for scope in reversed(list(scopes.values())):
                scope.restore()
            scopes.clear()

        unpatch()
        interp._patch_attr = attr
        try:
            out = run()
            assert not core.tensor.__add__.__qualname__.endswith("stand_in")
            return out
        finally:
            unpatch()
            interp._patch_attr = patch_attr

    assert torch.equal(patched_with(patch_attr._ds4t_original), ours)

    def losing_other(obj, name, member, builder, scope):
        patch_attr._ds4t_original(obj, name, member, builder, scope)
        stand_in = getattr(obj, name)
        scope.set_attr(obj, name, lambda *a, **k: stand_in(*a, **{key: v for key, v in k.items() if key != "other"}))

    assert not torch.equal(patched_with(losing_other), ours)
    assert torch.equal(run(), ours) and core.tensor.__add__.__qualname__.endswith("stand_in")   # ds4t's are back
