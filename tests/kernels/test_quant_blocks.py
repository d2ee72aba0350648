"""GGUF blocks kept as stored (ds4t.kernels.quant_blocks) and the kernels that read them (qlinear through
``linear``, qmoe through ``moe_experts``): against gguf-py's dequantize + torch, bitwise decoding, NaN-poisoned
outputs, row batch invariance (hypothesis) with a negative control."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ds4t.backend import INTERPRET
from ds4t.kernels import qmoe, weights
from ds4t.kernels.linear import linear, linear_heads, linear_parts, linear_ref
from ds4t.kernels.moe import moe_experts, moe_experts_ref
from ds4t.kernels.registry import use_variants
from ds4t.kernels.qlinear import (QLINEAR_CONFIGS, QLinearConfig, _gpu_rule, _x_cols, folds, qdot, qdot_pair,
                                  qlinear_config, qlinear_launch_config,
                                  nibble_pack, rows_aligned, x_rows)
from ds4t.kernels.quant_blocks import (BLOCKS_32, FORMATS, GGUF_LAYOUTS, K_HEADER, PLANE_ORDER, QTYPES, GGUFLayout,
                                       GGUFWeight, block_terms, dequantize, fold_weights, quantize, quantize_numpy,
                                       repack, scale_plane_bytes, unpack)
from ds4t.kernels.weights import RowParts
from tests.kernels.invariance import assert_rows_invariant, half_row_tiles, poison_empty, poisoned

DEV = torch.device("cpu" if INTERPRET else "cuda")
ADTS = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
"""Max |kernel - ref| / max |ref| by activation dtype. Both sides use the same weights (the exact dequantized
ones, or the fold route's bf16 ones: :func:`_route_weights`) and the same rounded activations; the kernel sums
per sub-block or per loop step, the reference x . w: fp32 sums in different orders."""


def _route_weights(w: GGUFWeight, fold: bool) -> torch.Tensor:
    """fp32 [N, K]: the weights a route multiplies -- gguf-py's dequantized values, or the fold route's."""
    return (fold_weights(w) if fold else w.dequantize()).float().to(DEV)


def random_blocks(shape, qtype: str, seed: int, exp=(-4, -2)) -> GGUFWeight:
    """A GGUFWeight [*shape] of random bytes (every bit pattern of quants and packed scales) with finite,
    moderate fp16 block scales: covers what a quantizer might never emit."""
    f = FORMATS[qtype]
    *lead, K = shape
    rng = np.random.default_rng(seed)
    n = int(np.prod(lead)) * (K // f.qk)
    raw = rng.integers(0, 256, size=(n, f.bpb), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, size=(n, 2)) * 10.0 ** rng.uniform(*exp, size=(n, 1))).astype(np.float16)
    if qtype in ("Q8_0", "Q4_0"):
        raw[:, 0:2] = scales[:, :1].view(np.uint8)
    elif qtype == "Q4_1":   # d and a min of either sign
        raw[:, 0:4] = (scales * np.where(rng.integers(0, 2, size=(n, 2)) == 1, 1, -1).astype(np.float16)
                       * np.array([1, -1], np.float16)).view(np.uint8).reshape(n, 4)
    elif qtype in K_HEADER:
        raw[:, 0:4] = scales.view(np.uint8).reshape(n, 4)
    else:
        raw[:, 208:210] = scales[:, :1].view(np.uint8)
    data = torch.from_numpy(raw.reshape(*lead, K // f.qk * f.bpb)).to(DEV)
    return GGUFWeight.from_blocks(data, qtype, K)


def _x(B, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, K, generator=g).to(dtype).to(DEV)


def _rel(y, ref):
    return ((y - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------- format and quantizers

@pytest.mark.parametrize("qtype", QTYPES)
def test_quantizer_round_trips_through_gguf_py(qtype):
    """Our blocks, decoded by gguf-py, are the weight up to the format's step (Q8_0: gguf-py's own quantizer)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 512, generator=g)
    w[1] -= 1.5                                  # an all-negative-ish row (Q4_K's min)
    w[2, :256] = 0.0                             # an all-zero block
    q = quantize(w, qtype)
    back = q.dequantize()
    step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8 * 1.01, "Q4_1": 1 / 15, "Q4_K": 1 / 15 * 1.3, "Q5_K": 1 / 31 * 1.3,
            "Q6_K": 1 / 31 * 1.1}[qtype]
    blocks = w.reshape(3, -1, FORMATS[qtype].sb)
    span = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True).clamp(max=0)).expand_as(blocks)
    assert ((back - w).abs().reshape_as(blocks) <= span * step + 1e-3).all()
    assert torch.equal(back[2, :256], torch.zeros(256))
    if qtype in BLOCKS_32:   # ggml's reference quantizers, as gguf-py has them
        import gguf

        assert np.array_equal(q.blocks().numpy(), gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype]))


def test_weight_type_rows_experts_and_errors():
    w = quantize(torch.randn(2, 6, 256), "Q4_K")
    assert w.shape == (2, 6, 256) and w.data.shape == (2, 6, 144) and w.nbytes == 2 * 6 * 144   # no padding
    assert w.blocks().shape == (2, 6, 144)
    assert torch.equal(w[1][2:4].dequantize(), w.dequantize()[1, 2:4])
    both = weights.cat([w[0][:2], w[1][3:]])
    assert torch.equal(both.dequantize(), torch.cat([w.dequantize()[0, :2], w.dequantize()[1, 3:]]))
    assert torch.equal(weights.stack([w[1], w[0]]).dequantize(), w.dequantize().flip(0))
    assert weights.joinable([w[0], w[1]]) and not weights.joinable([w[0], quantize(torch.randn(6, 256), "Q6_K")])
    q6 = quantize(torch.randn(6, 256), "Q6_K", act_dtype=torch.bfloat16)
    f = torch.randn(6, 256).bfloat16()
    floats = weights.cat([q6, f])   # blocks beside a float part: joined in float
    assert floats.dtype == torch.bfloat16 and torch.equal(floats, torch.cat([q6.dequantize(), f.float()]).bfloat16())
    with pytest.raises(ValueError, match="along K"):
        weights.cat([w[0], w[1]], dim=1)
    with pytest.raises(ValueError, match="multiple of 256"):
        GGUFWeight(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 100)
    with pytest.raises(ValueError, match="needs 288 bytes"):
        GGUFWeight(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 512)
    with pytest.raises(ValueError, match="not read as blocks"):
        GGUFWeight(torch.zeros(4, 110, dtype=torch.uint8), "Q3_K", 256)
    with pytest.raises(ValueError, match="multiple of its block"):
        quantize_numpy(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(TypeError, match="GGUF"):
        linear_heads(torch.randn(2, 2, 256), weights.stack([w[0][:3], w[0][3:]]))


@pytest.mark.parametrize("act", [None, torch.bfloat16])
def test_quantize_on_meta_has_the_cpus_layout(act):
    """On 'meta' (memory plans of full-depth models) quantize computes nothing but gives each type the data shape
    and layout (scale plane included) the CPU's quantization gives."""
    for qtype in QTYPES:
        cpu = quantize(torch.randn(3, 5, 512), qtype, act_dtype=act)
        meta = quantize(torch.empty(3, 5, 512, device="meta"), qtype, act_dtype=act)
        assert meta.data.is_meta and meta.data.dtype == cpu.data.dtype == torch.uint8
        assert (meta.shape, meta.data.shape, meta.scale_plane) == (cpu.shape, cpu.data.shape, cpu.scale_plane)


# ----------------------------------------------------------------------------- the repacked layout

def _mixed_parts(K=256, act=torch.bfloat16):
    """Rows of three GGUF matrices of K columns as a Q4_K_M file mixes them: q and k Q4_K, v Q6_K."""
    g = torch.Generator().manual_seed(3)
    return [quantize(torch.randn(n, K, generator=g) / 16, t, act_dtype=act).to(DEV)
            for n, t in ((48, "Q4_K"), (16, "Q4_K"), (32, "Q6_K"))]


def test_mixed_types_join_as_row_parts_that_keep_their_blocks():
    q, k, v = _mixed_parts()
    w = weights.cat([q, k, v])   # q and k merge (one type); v stays a part of its own
    assert isinstance(w, RowParts) and w.qtype == "Q4_K+Q6_K" and w.shape == (96, 256)
    assert [p.shape[0] for p in w.parts] == [64, 32] and w.nbytes == q.nbytes + k.nbytes + v.nbytes
    full = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(w.dequantize(), full) and not weights.joinable([q, v])
    # rows as tensor parallelism and the loaders cut them: slices across parts, a permutation, a re-join
    assert torch.equal(w[..., 40:70, :].dequantize(), full[40:70]) and isinstance(w[:10], GGUFWeight)
    perm = torch.cat([torch.arange(64, 96), torch.arange(0, 64)])
    assert torch.equal(w[perm].dequantize(), full[perm]) and w[perm].qtype == "Q6_K+Q4_K"
    halves = weights.cat([w[..., 0:30, :], w[..., 30:96, :]], dim=-2)
    assert isinstance(halves, RowParts) and len(halves.parts) == 2 and torch.equal(halves.dequantize(), full)
    with pytest.raises(ValueError, match="K, act_dtype"):
        RowParts((q, quantize(torch.randn(8, 512), "Q6_K", act_dtype=torch.bfloat16).to(DEV)))
    with pytest.raises(ValueError, match="adjacent parts of one format"):
        RowParts((q, k))
    with pytest.raises(IndexError, match="rows only"):
        w[:, :128]


@pytest.mark.parametrize("adt", ADTS, ids=str)
def test_row_parts_linear_is_each_part_alone(adt):
    """A RowParts linear: each part's columns are bit for bit that part's lone linear (whatever the batch, so
    rows alone == in a batch), the bias cut with them; the split-K-deferring entry returns the finished result.
    Control: the same rows joined in float (how mixed fusions ran before) give other bits."""
    q, k, v = (p.with_act_dtype(adt) for p in _mixed_parts())
    w = weights.cat([q, k, v])
    B = 6
    x, b = _x(B, 256, 1), torch.randn(96, device=DEV)
    y = linear(x, w, b, out=poisoned((B, 96), device=DEV))
    assert torch.equal(y[:, :64], linear(x, weights.cat([q, k]), b[:64]))
    assert torch.equal(y[:, 64:], linear(x, v, b[64:]))
    assert all(torch.equal(linear(x[i:i + 1], w, b)[0], y[i]) for i in (0, 3, B - 1))
    assert torch.equal(linear_parts(x, w, b).part[0], y)
    ref = linear_ref(x, w, b)
    assert _rel(y, ref) < (1e-2 if adt == torch.bfloat16 else 1e-5)   # bf16: the fold route's rounded weights
    floats = linear(x, w.dequantize(adt), b)
    assert not torch.equal(floats, y)


@pytest.mark.parametrize("qtype,K", [("Q8_0", 96), ("Q8_0", 256), ("Q4_0", 96), ("Q4_1", 160), ("Q4_K", 512),
                                     ("Q5_K", 768), ("Q6_K", 256), ("Q6_K", 2048)])
def test_repack_round_trips_and_aligns(qtype, K):
    """repack then unpack gives the ggml bytes back; planes start on 16 bytes and rows are multiples of 16
    (padding only where the blocks do not fill one); each plane holds its byte range of every block."""
    f = FORMATS[qtype]
    raw = torch.from_numpy(np.random.default_rng(K).integers(0, 256, (2, 3, K // f.qk * f.bpb), dtype=np.uint8))
    w = GGUFWeight.from_blocks(raw, qtype, K)
    assert torch.equal(w.blocks(), raw) and torch.equal(unpack(repack(raw, qtype, K), qtype, K), raw)
    R = f.row_bytes(K)
    assert w.data.shape == (2, 3, R) and R % 16 == 0 and all(o % 16 == 0 for o in f.plane_offsets(K))
    assert R - K // f.qk * f.bpb < 16 * len(f.planes)
    blocks = raw.reshape(2, 3, K // f.qk, f.bpb)
    for (lo, hi), at in zip(f.planes, f.plane_offsets(K)):
        assert torch.equal(w.data[..., at:at + K // f.qk * (hi - lo)], blocks[..., lo:hi].reshape(2, 3, -1))
    assert torch.equal(w[1][1:].blocks(), raw[1, 1:])                         # rows keep their planes
    j = min(1, K // f.qk - 1)                                                 # K cut on blocks: block j
    assert torch.equal(w.cols(j * f.qk, (j + 1) * f.qk).blocks(), raw[..., j * f.bpb:(j + 1) * f.bpb])
    with pytest.raises(ValueError, match="do not fall"):
        w.cols(1, f.qk)


# ----------------------------------------------------------------------------- the Q4_K / Q5_K scale plane

@pytest.mark.parametrize("qtype", K_HEADER)
def test_scale_plane_layout_round_trips(qtype):
    """A Q4_K / Q5_K row with its scale plane: the repacked row then K / 8 bytes of bf16 (s, -mn) in
    PLANE_ORDER, each s = d sc and mn = dmin m of gguf-py's decoding rounded once to bf16; the ggml blocks
    come back bit for bit; rows, experts, columns and joins keep the plane; other types refuse one."""
    K = 512
    w = random_blocks((2, 3, K), qtype, seed=5)
    wp = w.with_scale_plane()
    R = FORMATS[qtype].row_bytes(K)
    assert wp.data.shape == (2, 3, R + scale_plane_bytes(K)) and wp.row_bytes == R + K // 8
    assert torch.equal(wp.data[..., :R], w.data) and torch.equal(wp.blocks(), w.blocks())
    q, s, mn = block_terms(w.blocks(), qtype, K)
    plane = wp.data[..., R:].contiguous().view(torch.bfloat16).reshape(2, 3, K // 256, 16)
    order = torch.tensor(PLANE_ORDER)
    sub_s = s.reshape(2, 3, K // 256, 8, 32)[..., 0][..., order]
    sub_mn = mn.reshape(2, 3, K // 256, 8, 32)[..., 0][..., order]
    assert torch.equal(plane, torch.cat([sub_s, -sub_mn], -1).float().to(torch.bfloat16))
    assert torch.equal(wp.with_scale_plane(False).data, w.data) and wp.with_scale_plane() is wp
    assert wp.nbytes == w.nbytes + 6 * K // 8
    assert wp[1][1:].scale_plane and torch.equal(wp[1][1:].blocks(), w[1][1:].blocks())
    cut = wp.cols(256, 512)
    assert cut.scale_plane and torch.equal(cut.data, w.cols(256, 512).with_scale_plane().data)
    assert weights.stack([wp[0], wp[1]]).scale_plane and not weights.joinable([wp[0], w[1]])
    with pytest.raises(ValueError, match="only Q4_K"):
        random_blocks((4, 256), "Q8_0", seed=1).with_scale_plane()
    with pytest.raises(ValueError, match="with its scale plane"):
        GGUFWeight(w.data, qtype, K, scale_plane=True)


def test_layout_table_decides_the_plane_at_load():
    """with_act_dtype (what load calls) lays a weight out as GGUF_LAYOUTS says for (type, activation dtype):
    in the interpreter a plane for bf16 Q4_K / Q5_K only; a forced table turns it off (or on) for every weight."""
    w = random_blocks((16, 256), "Q4_K", seed=2)
    assert INTERPRET is False or w.with_act_dtype(torch.bfloat16).scale_plane
    assert INTERPRET is False or random_blocks((16, 256), "Q5_K", seed=2).with_act_dtype(torch.bfloat16).scale_plane
    assert not w.with_act_dtype(torch.float32).scale_plane
    assert not random_blocks((16, 256), "Q8_0", seed=2).with_act_dtype(torch.bfloat16).scale_plane
    assert quantize(torch.randn(16, 256), "Q4_K", act_dtype=torch.bfloat16).scale_plane == \
        GGUF_LAYOUTS("Q4_K", torch.bfloat16).scale_plane
    for on in (False, True):
        with GGUF_LAYOUTS.forced(lambda qtype, adt: GGUFLayout(scale_plane=on and qtype == "Q4_K")):
            assert w.with_act_dtype(torch.bfloat16).scale_plane is on


def _corrupt_plane(w: GGUFWeight) -> GGUFWeight:
    """Negative control: ``w`` with the last block's first plane scale of every row doubled (its header kept)."""
    data = w.data.clone()
    at = data.shape[-1] - 32
    s = data[..., at:at + 2].contiguous().view(torch.bfloat16) * 2
    data[..., at:at + 2] = s.view(torch.uint8)
    return dataclasses.replace(w, data=data)


@pytest.mark.parametrize("cfg", [QLinearConfig(block_n=16, split=2, fold=True),
                                 QLinearConfig(block_n=32, split=1, fold=True, pair=True),
                                 QLinearConfig(block_n=64, split=3, fold=True)], ids=str)
@pytest.mark.parametrize("qtype", K_HEADER)
def test_scale_plane_changes_no_bit(qtype, cfg):
    """The fold route through the scale plane gives the header route's bits (same bf16 scales, same
    operations); fp32 activations take the exact route, which reads the header. Control: a plane whose
    values differ from the header's is what the kernel reads on the fold route (and only there).

    Except on the GPU at mma.sync tiles (fewer than 64 weight rows, or not whole warpgroups; wgmma needs both on
    sm_90): there Triton 3.6 lays the header route's weight operand out with kWidth 8 (its values come from
    8-bit loads) and the plane route's with kWidth 4, which assigns the K columns to the m16n8k16 instructions in
    another order, so the fp32 sums round differently (measured on an H100: up to 2.3e-5 on outputs up to ~50; both
    fixed per launch config, never per batch). There the two must agree to fp32 summation-order tolerance."""
    K, N, B = 768, 50, 5
    w = random_blocks((N, K), qtype, seed=21)
    wp = w.with_scale_plane()
    x, b = _x(B, K, 22), torch.randn(N).to(DEV)
    for adt in (torch.bfloat16, torch.float32):
        base = linear(x, w, b, config=cfg, act_dtype=adt, out=poisoned((B, N), device=DEV))
        plane = linear(x, wp, b, config=cfg, act_dtype=adt, out=poisoned((B, N), device=DEV))
        assert not torch.isnan(plane).any()
        if INTERPRET or adt == torch.float32 or nibble_pack(cfg.num_warps, cfg.block_n) == 2:   # wgmma tiles
            assert torch.equal(base, plane)
        else:
            assert (plane - base).abs().max() <= 4e-6 * base.abs().max()
        bad = linear(x, _corrupt_plane(wp), b, config=cfg, act_dtype=adt)
        assert torch.equal(bad, base) is (adt == torch.float32)


# ----------------------------------------------------------------------------- linear

@triton.jit
def _read_tile_kernel(x_ptr, y_ptr, B, stride, BM: tl.constexpr, C: tl.constexpr, NULL_PADDING: tl.constexpr):
    rm = tl.arange(0, BM)
    if NULL_PADDING:
        x_row = x_rows(x_ptr, rm, rm < B, stride)
    else:   # padding rows pointed at the last real row
        x_row = x_ptr + tl.minimum(rm, B - 1).to(tl.int64) * stride
    tile = _x_cols(x_row, tl.arange(0, C), tl.float32)   # [C, BM]
    tl.store(y_ptr + rm[None, :] * C + tl.arange(0, C)[:, None], tile)


def test_padding_rows_of_a_tile_read_zeros():
    """The activation tile of B = 3 rows in a 16-row tile: rows < B read their own row, the padding rows are
    null pointers read as zeros (no memory traffic; their outputs are never stored). Control: pointing the
    padding rows at the last real row, as the kernels did before, reads that row."""
    x = torch.randn(3, 64, device=DEV)
    got = {null: torch.full((16, 64), float("nan"), device=DEV) for null in (True, False)}
    for null, y in got.items():
        _read_tile_kernel[(1,)](x, y, 3, x.stride(0), BM=16, C=64, NULL_PADDING=null)
    assert torch.equal(got[True][:3], x) and not got[True][3:].any()
    assert torch.equal(got[False][:3], x) and torch.equal(got[False][3:], x[2].expand(13, 64))


def test_misaligned_activation_rows_are_copied_and_keep_the_bits():
    """x_rows promises 16-byte aligned rows: an activation view starting 2 bytes into its storage is copied by
    the launcher (rows_aligned) and gives the bits of its aligned copy; an aligned x is passed as is."""
    base = torch.randn(5, 257, device=DEV).to(torch.bfloat16)
    view = base[:, 1:]                      # unit stride, data 2 bytes past an aligned address
    assert view.data_ptr() % 16 and rows_aligned(view).data_ptr() % 16 == 0
    assert torch.equal(rows_aligned(view), view)
    aligned = view.contiguous()
    assert rows_aligned(aligned) is aligned
    w = random_blocks((40, 256), "Q4_0", seed=31)
    assert torch.equal(linear(view, w, act_dtype=torch.bfloat16), linear(aligned, w, act_dtype=torch.bfloat16))


@pytest.mark.parametrize("adt", ADTS, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_decodes_blocks_bitwise_as_gguf_py(qtype, adt):
    """x = the identity: row k of the result is column k of the weight, which the kernel must decode to
    exactly gguf-py's fp32 value (s * q - mn is one rounding; the other terms add exact zeros). With bf16
    activations the integers go through the GPU's packed conversions (backend.int8_to / nibbles_to /
    six_bit_to)."""
    K = 256
    w = random_blocks((40, K), qtype, seed=3).with_act_dtype(adt)
    exact = dataclasses.replace(qlinear_config(K, 40, qtype, adt), fold=False)
    y = linear(torch.eye(K, device=DEV), w, config=exact, out=poisoned((K, 40), device=DEV))
    assert torch.equal(y.t().cpu(), dequantize(w.blocks().cpu(), qtype, K))


@pytest.mark.parametrize("qtype", QTYPES)
def test_fold_route_decodes_blocks_as_fold_weights(qtype):
    """The fold route (bf16 activations) multiplies each weight as one packed bf16 FMA gives it,
    ``q * bf16(s) - bf16(mn)`` rounded once: the identity reads back :func:`fold_weights` bit for bit, whose
    terms are gguf-py's (s * q - mn equals its dequantize). Control: those weights are not gguf-py's values
    rounded once to bf16 (the scales' own rounding shows), and fp32 activations keep the exact route."""
    K = 512
    w = random_blocks((24, K), qtype, seed=3).with_act_dtype(torch.bfloat16)   # N tiles of 16: one ragged
    q, s, mn = block_terms(w.blocks(), qtype, K)
    deq = dequantize(w.blocks().cpu(), qtype, K)
    assert torch.equal((q * s - mn).float().cpu(), deq)
    cfg = QLinearConfig(block_n=16, split=2, group=4 if qtype in BLOCKS_32 else 1, fold=True)
    y = linear(torch.eye(K, device=DEV), w, config=cfg, out=poisoned((K, 24), device=DEV))
    folded = fold_weights(w)
    assert folded.dtype == torch.bfloat16 and torch.equal(y.t().cpu(), folded.float().cpu())
    assert not torch.equal(folded.float().cpu(), deq.to(torch.bfloat16).float())
    y32 = linear(torch.eye(K, device=DEV), w.with_act_dtype(torch.float32), config=cfg)
    assert torch.equal(y32.t().cpu(), deq)


@pytest.mark.parametrize("adt", ADTS, ids=str)
@pytest.mark.parametrize("qtype,B,K,N", [("Q8_0", 5, 96, 33), ("Q4_0", 2, 64, 17), ("Q4_1", 6, 160, 45),
                                         ("Q4_K", 3, 512, 70), ("Q5_K", 4, 768, 40),
                                         ("Q6_K", 17, 256, 21)])
def test_linear_matches_gguf_py_reference(qtype, B, K, N, adt):
    w = random_blocks((N, K), qtype, seed=B + N).with_act_dtype(adt)
    x = _x(B, K, seed=B)
    b = torch.randn(N).to(DEV)
    y = linear(x, w, b, out=poisoned((B, N), device=DEV))
    if folds(qlinear_config(K, N, qtype, adt), adt):   # the table's route (bf16 Q8_0 / Q4_K): its own weights
        ref = x.to(adt).double() @ _route_weights(w, True).double().t() + b.double()
        assert _rel(y.double(), ref) <= TOL[adt]
        return
    ref = linear_ref(x, w, b)   # gguf-py's dequantize (as_float), x rounded to adt, fp32 matmul
    assert _rel(y, ref) <= TOL[adt]
    deq = torch.from_numpy(__import__("gguf").quants.dequantize(
        w.blocks().cpu().numpy(), __import__("gguf").GGMLQuantizationType[qtype])).to(DEV)
    direct = x.to(adt).double() @ deq.double().t() + b.double()
    assert _rel(y.double(), direct) <= TOL[adt]


# Configs that exercise the GPU code paths in the interpreter: split-K (ragged last split), several N
# tiles, Q8_0 blocks per step.
PATH_CONFIGS = [QLinearConfig(block_n=16, split=3, group=2), QLinearConfig(block_n=64, split=2, group=1),
                QLinearConfig(block_n=32, split=1, group=4), QLinearConfig(block_n=16, split=3, group=2, fold=True),
                QLinearConfig(block_n=64, split=2, group=1, fold=True)]


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", PATH_CONFIGS, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_gpu_paths_match_reference(qtype, cfg, adt):
    K = 256 if qtype in BLOCKS_32 else 768
    w = random_blocks((50, K), qtype, seed=11)
    x = _x(4, K, seed=2)
    b = torch.randn(50).to(DEV)
    y = linear(x, w, b, config=cfg, act_dtype=adt, out=poisoned((4, 50), device=DEV))
    ref = x.to(adt).double() @ _route_weights(w, folds(cfg, adt)).double().t() + b.double()
    assert _rel(y.double(), ref) <= TOL[adt]


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_pair_changes_no_bit(qtype):
    """QLinearConfig.pair (two adjacent N tiles per program, stepped through K together): the bits of the
    unpaired launch, with a bias, split K and N = 80 (three 32-row tiles: the last pair half outside)."""
    K, N, B = 512, 80, 5
    w = random_blocks((N, K), qtype, 41)
    x = _x(B, K, 42, torch.bfloat16)
    bias = _x(1, N, 43)[0]
    base = QLinearConfig(block_n=32, split=2, group=4 if qtype in BLOCKS_32 else 1)
    outs = [linear(x, w, bias, config=dataclasses.replace(base, pair=pr), out=poisoned((B, N), device=DEV))
            for pr in (False, True)]
    assert not torch.isnan(outs[1]).any() and torch.equal(outs[0], outs[1])


def _rows_linear(x, w, base, rows):
    """linear(x, w) with ``base`` as the decode entry and ``rows`` (or no) ("rows",) entry; NaN-poisoned out."""
    with QLINEAR_CONFIGS.forced(lambda K, N, qt, adt, *r: rows if r else base):
        assert qlinear_launch_config(x.shape[1], w.shape[0], w.qtype, w.act_dtype or x.dtype, x.shape[0]) == \
            (rows if rows is not None and x.shape[0] >= rows.min_rows else base)
        return linear(x, w, out=poisoned((x.shape[0], w.shape[0]), device=DEV))


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q4_1"])
def test_rows_entry_block_m_changes_no_bit(qtype, adt):
    """A prefill launch's rows entry (tiles of 32 / 64 activation rows) gives the decode entry's bits on
    every route (bf16: the table's, fold for all but Q6_K; fp32: exact), split K included (two splits of two
    K steps); 40 rows leave a partial last tile. Control: the same rows unsplit (another sum order) differ."""
    K, N, B = 1024, 48, 40
    w = random_blocks((N, K), qtype, 61)
    x = _x(B, K, 62, adt)
    base = dataclasses.replace(qlinear_config(K, N, qtype, adt), split=2)
    want = _rows_linear(x, w, base, None)
    for bm in (32, 64):
        got = _rows_linear(x, w, base, dataclasses.replace(base, block_m=bm, min_rows=20))
        assert not torch.isnan(got).any() and torch.equal(got, want), bm
    assert not torch.equal(_rows_linear(x, w, dataclasses.replace(base, split=1), None), want)


def test_gpu_rows_entries_hold_more_rows_and_nothing_else():
    """The GPU's rows entries (prefill launches): the decode entry with 32-row tiles (Q6_K 64) from 128 rows
    for the linear, 32-pair tiles from 128 rows for the MoE (16 in its row programs from 64); warps and every other field the decode entry's (4 warps over a
    2-warp entry changed bits on an H100)."""
    from ds4t.kernels.qlinear import QLINEAR_CONFIGS as T
    for K, N in [(7168, 36864), (2048, 12352), (5120, 1536)]:
        for qt in ("Q8_0", "Q4_K", "Q6_K", "Q5_K"):
            dec = T.gpu.get((K, N, qt, torch.bfloat16)) or _gpu_rule(K, N, qt, torch.bfloat16)
            rows = _gpu_rule(K, N, qt, torch.bfloat16, "rows")
            assert rows == dataclasses.replace(dec, block_m=64 if qt == "Q6_K" else 32, min_rows=128), (K, N, qt)
    for key, cfg in qmoe.QMOE_CONFIGS.gpu.items():
        if key[-1] == "rows":
            assert cfg == dataclasses.replace(qmoe.QMOE_CONFIGS.gpu[key[:-1]], row_programs=True, min_rows=64,
                                              block_m=32, block_m_rows=128), key


def test_rows_entry_may_change_tile_rows_warps_and_stages_only():
    base = QLinearConfig(block_n=32, split=1, group=4)
    bad = dataclasses.replace(base, block_n=64, block_m=64, min_rows=8)
    with QLINEAR_CONFIGS.forced(lambda K, N, qt, adt, *r: bad if r else base):
        assert qlinear_launch_config(512, 48, "Q8_0", torch.bfloat16, 4) == base
        with pytest.raises(ValueError, match="num_stages only"):
            qlinear_launch_config(512, 48, "Q8_0", torch.bfloat16, 8)


@pytest.mark.parametrize("plane", [False, True])
@pytest.mark.parametrize("qtype", QTYPES)
def test_prefetch_changes_no_bit(qtype, plane):
    """QLinearConfig.prefetch_l2 (an L2 hint for the quant bytes one or two steps on: no value is loaded): the
    unprefetched launch's bits, on a ragged split K, in pairs, through the scale plane, on both routes."""
    if plane and qtype not in K_HEADER:
        pytest.skip("scale planes are Q4_K / Q5_K only")
    if INTERPRET and qtype not in ("Q8_0", "Q4_K"):
        pytest.skip("the hint is nothing in the interpreter: two types (both byte spans) run its code here")
    K, N, B = 1024 if qtype not in BLOCKS_32 else 320, 40, 3
    w = random_blocks((N, K), qtype, seed=51)
    w = w.with_scale_plane() if plane else w
    x = _x(B, K, 52)
    for base in (QLinearConfig(block_n=16, split=3, group=2 if qtype in BLOCKS_32 else 1, fold=True),
                 QLinearConfig(block_n=16, split=3, group=2 if qtype in BLOCKS_32 else 1, fold=False),
                 QLinearConfig(block_n=16, split=1, group=1, fold=True, pair=True)):
        want = linear(x, w, None, config=base, act_dtype=torch.bfloat16)
        for fields in (dict(prefetch_l2=1), dict(prefetch_l2=2)):
            got = linear(x, w, None, config=dataclasses.replace(base, **fields), act_dtype=torch.bfloat16,
                         out=poisoned((B, N), device=DEV))
            assert not torch.isnan(got).any() and torch.equal(got, want), fields


def test_moe_prefetch_changes_no_bit():
    """QMoEConfig.prefetch_l2 in both grouped kernels (gate and up interleaved or not): the bits of the
    unprefetched launch."""
    # the GPU: 3 K steps for gate / up, 2 for down (an L2 hint past the last step clamped in both); the
    # interpreter, where the hint is nothing and only the code runs: 2 and 2, fewer rows
    B, D = (3, 512) if INTERPRET else (5, 768)
    h, ids, wts, wg, wu, wd = _moe_data("Q4_K", "Q4_K", seed=17, B=B, D=D, I=512)
    E = wg.shape[0]
    outs = []
    for fields in (dict(), dict(prefetch_l2=1), dict(prefetch_l2=2, interleave=False)):
        cfg = qmoe.QMoEConfig(tile_n=32, q8_group=4, fold=True, **fields)
        with use_variants({"moe_experts": "gpu"}), \
                qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *rows: None if rows else cfg):
            outs.append(moe_experts(h, ids, wts, wg, wu, wd, shared_expert=E - 1, act_dtype=torch.bfloat16,
                                    out=poisoned((h.shape[0], h.shape[1]), device=DEV)))
    assert not torch.isnan(outs[0]).any() and all(torch.equal(outs[0], o) for o in outs[1:])


def test_config_never_sees_the_batch():
    for qt in QTYPES:
        for adt in (torch.float32, torch.bfloat16):
            cfg = _gpu_rule(4096, 14336, qt, adt)
            assert cfg.k_per_split(4096, qt) % cfg.k_step(qt) == 0
            assert cfg.fold == (adt == torch.bfloat16 and qt != "Q6_K")
    assert qmoe.QMOE_CONFIGS("gate_up", "Q5_K") == qmoe.QMOE_CONFIGS("gate_up", "Q4_K")   # untimed: Q4_K's
    assert qlinear_config(512, 80, "Q4_K", torch.float32) is qlinear_config(512, 80, "Q4_K", torch.float32)
    with pytest.raises(ValueError, match="does not tile"):
        linear(_x(1, 96, 0), random_blocks((8, 96), "Q8_0", 0), config=QLinearConfig(block_n=16, split=1, group=2))


POOL = 36
_POOLS = {}


def _pool(qtype):
    """(x [POOL, K], weight [24, K], bias) of ``qtype``, or of "Q4_K+plane" / "Q5_K+plane" (rows with their scale
    plane)."""
    if qtype not in _POOLS:
        base, _, plane = qtype.partition("+")
        K = 128 if base in BLOCKS_32 else 512   # several sub-blocks per split: a split regroups the sum
        w = random_blocks((24, K), base, seed=5).with_scale_plane(bool(plane))
        _POOLS[qtype] = (_x(POOL, K, seed=9), w, torch.randn(24).to(DEV))
    return _POOLS[qtype]


@st.composite
def batches(draw):
    B = draw(st.integers(1, 33))
    rows = draw(st.permutations(range(POOL)))[:B]
    return rows, draw(st.integers(0, B - 1))


PROPERTY = settings(max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=list(HealthCheck))


def _check(launch, qtype, batch):
    x, w, b = _pool(qtype)
    rows, i = batch
    assert_rows_invariant(lambda idx: launch(x[idx].contiguous(), w, b), rows, i)


@PROPERTY
@given(batch=batches(), qtype=st.sampled_from([*QTYPES, "Q4_K+plane", "Q5_K+plane"]), cfg=st.sampled_from([None, *PATH_CONFIGS]),
       adt=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rows_invariant(batch, qtype, cfg, adt):
    _check(lambda x, w, b: linear(x, w, b, config=cfg, act_dtype=adt), qtype, batch)


def _split_from_batch(x, w, b, fold=False):
    """Negative control: the split-K count follows the batch size (what the config must never do); ``fold``:
    on the fold route with bf16 activations (a Q4_K weight's scale plane is read there)."""
    cfg = QLinearConfig(block_n=16, split=1 if x.shape[0] == 1 else 2, group=1, fold=fold)
    return linear(x, w, b, config=cfg, act_dtype=torch.bfloat16 if fold else None)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q4_K+plane", "Q5_K+plane"])
def test_negative_control_is_caught(qtype):
    fold = qtype.endswith("+plane")

    @settings(max_examples=25, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(batch=batches())
    def prop(batch):
        _check(lambda x, w, b: _split_from_batch(x, w, b, fold), qtype, batch)

    with pytest.raises(AssertionError, match="differs between batch"):
        prop()


# ----------------------------------------------------------------------------- MoE

def _moe_data(qg, qd, seed, B=5, E=4, k=2, D=256, I=256):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, D, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)]).to(DEV, torch.int32)
    ids[1] = ids[0].flip(0)
    wts = torch.rand(B, k, generator=g).to(DEV)
    wg, wu = (random_blocks((E, I, D), qg, seed + j, exp=(-5, -4)) for j in (1, 2))
    wd = random_blocks((E, D, I), qd, seed + 3, exp=(-5, -4))
    return h, ids, wts, wg, wu, wd


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qg,qd,path", [("Q4_K", "Q6_K", "interp"), ("Q8_0", "Q4_K", "gpu"),
                                        ("Q6_K", "Q8_0", "host_list"), ("Q5_K", "Q5_K", "gpu"), ("Q4_1", "Q4_0", "gpu")])
def test_moe_matches_reference_and_rows_alone(qg, qd, path, adt):
    with use_variants({"moe_experts": path if INTERPRET else "gpu"}):
        _moe_case(qg, qd, adt)


def _moe_case(qg, qd, adt):
    h, ids, wts, wg, wu, wd = _moe_data(qg, qd, seed=7)
    E = wg.shape[0]
    gate = torch.randn(h.shape[0]).to(DEV)
    o = moe_experts(h, ids, wts, wg, wu, wd, shared_expert=E - 1, shared_gate=gate, act_dtype=adt,
                    out=poisoned((h.shape[0], h.shape[1]), device=DEV))
    # each kernel against the weights of its route (the table's: fold for bf16 Q8_0 / Q4_K)
    routes = (folds(qmoe.QMOE_CONFIGS(k, w.qtype), adt) for k, w in (("gate_up", wg), ("gate_up", wu), ("down", wd)))
    wr = [_route_weights(w, True).to(adt) if fo else w for w, fo in zip((wg, wu, wd), routes)]
    ref = moe_experts_ref(h, ids, wts, *wr, shared_expert=E - 1, shared_gate=gate,
                          act_dtype=None if isinstance(wr[0], torch.Tensor) else adt)
    assert _rel(o, ref) <= 1e-4
    for i in (0, 1, 4):   # rows 0 and 1 share their experts
        one = moe_experts(h[i:i + 1], ids[i:i + 1], wts[i:i + 1], wg, wu, wd, shared_expert=E - 1,
                          shared_gate=gate[i:i + 1], act_dtype=adt)
        assert torch.equal(one[0], o[i])


def test_moe_interleave_changes_no_bit():
    """QMoEConfig.interleave (gate and up through K together, or one after the other): the same bits."""
    h, ids, wts, wg, wu, wd = _moe_data("Q4_K", "Q8_0", seed=11)
    E = wg.shape[0]
    outs = []
    for il in (True, False):
        cfg = qmoe.QMoEConfig(tile_n=32, q8_group=4, interleave=il)
        with use_variants({"moe_experts": "gpu"}), \
                qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *rows: None if rows else cfg):
            outs.append(moe_experts(h, ids, wts, wg, wu, wd, shared_expert=E - 1, act_dtype=torch.bfloat16,
                                    out=poisoned((h.shape[0], h.shape[1]), device=DEV)))
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])


def test_fp32_activations_never_interleave():
    """An interleaved gate/up with fp32 activations spills its registers on the GPU (qmoe.interleaves): such a
    launch steps gate and up one after the other whatever the config says; 16-bit activations follow the config."""
    cfg = qmoe.QMoEConfig(tile_n=32, interleave=True)
    assert not qmoe.interleaves(cfg, torch.float32)
    assert qmoe.interleaves(cfg, torch.bfloat16) and qmoe.interleaves(cfg, torch.float16)
    assert not qmoe.interleaves(dataclasses.replace(cfg, interleave=False), torch.bfloat16)


def _moe_row_programs(gu, dn, B=24, block_m=16):
    """moe_experts over GGUF experts (Q4_K gate/up, Q8_0 down; a shared expert holding all B rows: 2 row
    tiles) with ("rows",) entries from 8 rows whose ``row_programs`` are ``gu`` / ``dn`` and whose tiles hold
    ``block_m`` pairs; NaN-poisoned output."""
    h, ids, wts, wg, wu, wd = _moe_data("Q4_K", "Q8_0", seed=13, B=B, E=5)
    E = wg.shape[0]
    base = qmoe.QMoEConfig(tile_n=32, q8_group=4)
    rows = {"gate_up": dataclasses.replace(base, row_programs=gu, min_rows=8, block_m=block_m),
            "down": dataclasses.replace(base, row_programs=dn, min_rows=8, block_m=block_m)}
    with use_variants({"moe_experts": "gpu"}), \
            qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *r: rows[kernel] if r else base):
        return moe_experts(h, ids, wts, wg, wu, wd, shared_expert=E - 1, act_dtype=torch.bfloat16,
                           out=poisoned((h.shape[0], h.shape[1]), device=DEV))


@pytest.mark.parametrize("gu,dn", [(True, True), (True, False), (False, True)])
def test_moe_row_programs_change_no_bit(gu, dn):
    """GGUF experts in row programs (one program per row tile; either kernel or both): the per-expert
    programs' bits. Negative control (interpreter: jit helpers are looked up at call time): a tile finder
    that drops half of every tile is caught."""
    want = _moe_row_programs(False, False)
    got = _moe_row_programs(gu, dn)
    assert not torch.isnan(got).any() and torch.equal(got, want)
    if INTERPRET and gu and dn:
        with pytest.MonkeyPatch.context() as m:
            poison_empty(m)
            m.setattr(qmoe, "_program_tile", half_row_tiles)
            assert not torch.equal(_moe_row_programs(True, True), want)


@pytest.mark.parametrize("gu,dn", [(True, True), (False, False)])
def test_moe_rows_entry_block_m_changes_no_bit(gu, dn):
    """Row tiles of 32 pairs (the shared expert's 24 rows in one tile, others partial) in row programs and in
    per-expert programs: the 16-pair tiles' bits."""
    want = _moe_row_programs(False, False)
    got = _moe_row_programs(gu, dn, block_m=32)
    assert not torch.isnan(got).any() and torch.equal(got, want)


def test_moe_rows_entry_tile_pairs_follow_the_launch_rows(monkeypatch):
    """``block_m`` applies from ``block_m_rows`` rows, fewer take 16-pair tiles (at about one pair an expert, 32-pair
    tiles made an H100's Qwen3-Next-4l Q4_K step at N = 64 9.7 % slower); the bits are the same either way."""
    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["BM"])
                return self.kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(qmoe, "_qmoe_gate_up_kernel", Spy(qmoe._qmoe_gate_up_kernel))
    monkeypatch.setattr(qmoe, "_qmoe_down_kernel", Spy(qmoe._qmoe_down_kernel))
    h, ids, wts, wg, wu, wd = _moe_data("Q8_0", "Q8_0", seed=17, B=24, E=5)
    base = qmoe.QMoEConfig(tile_n=32, q8_group=4)
    outs = {}
    for name, gate in (("below", 25), ("from", 24)):
        rows = dataclasses.replace(base, row_programs=True, min_rows=8, block_m=32, block_m_rows=gate)
        seen.clear()
        with use_variants({"moe_experts": "gpu"}), \
                qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *r: rows if r else base):
            outs[name] = moe_experts(h, ids, wts, wg, wu, wd, shared_expert=wg.shape[0] - 1, act_dtype=torch.bfloat16)
        assert seen == ([16, 16] if name == "below" else [32, 32]), (name, seen)
    assert torch.equal(outs["below"], outs["from"])


def test_moe_rows_entry_may_change_programs_tiles_warps_and_stages_only():
    base = qmoe.QMoEConfig(tile_n=32, q8_group=4)
    bad = dataclasses.replace(base, tile_n=64, row_programs=True, min_rows=8)
    with qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *r: bad if r else base):
        assert qmoe.qmoe_config("down", "Q8_0", 4) == base
        with pytest.raises(ValueError, match="num_stages only"):
            qmoe.qmoe_config("down", "Q8_0", 8)
    ok = dataclasses.replace(base, block_m=64, row_programs=True, min_rows=8)
    with qmoe.QMOE_CONFIGS.forced(lambda kernel, qt, *r: ok if r else base):
        assert qmoe.qmoe_config("down", "Q8_0", 8) == ok


@pytest.mark.parametrize("qtype", K_HEADER)
def test_moe_scale_plane_changes_no_bit(qtype):
    """Q4_K / Q5_K experts (gate/up and down) through their scale planes on the fold route: the header route's
    bits; a gate with a plane and an up without one are refused (one loop reads both). Control: a corrupted
    down plane changes the output."""
    h, ids, wts, wg, wu, wd = _moe_data(qtype, qtype, seed=17)
    E = wg.shape[0]

    def run(g, u, d):
        with use_variants({"moe_experts": "gpu"}):
            return moe_experts(h, ids, wts, g, u, d, shared_expert=E - 1, act_dtype=torch.bfloat16,
                               out=poisoned((h.shape[0], h.shape[1]), device=DEV))

    planes = [w.with_scale_plane() for w in (wg, wu, wd)]
    base, plane = run(wg, wu, wd), run(*planes)
    assert not torch.isnan(plane).any() and torch.equal(base, plane)
    assert not torch.equal(run(planes[0], planes[1], _corrupt_plane(planes[2])), base)
    with pytest.raises(ValueError, match="layout"):
        run(planes[0], wu, wd)


def test_moe_weight_errors():
    h, ids, wts, wg, wu, wd = _moe_data("Q4_K", "Q6_K", seed=1)
    with pytest.raises(ValueError, match="one GGUF type"):
        moe_experts(h, ids, wts, wg, random_blocks(tuple(wu.shape), "Q6_K", 0), wd)
    with pytest.raises(TypeError, match="cannot mix"):
        moe_experts(h, ids, wts, wg, wu, wd.dequantize())


@triton.jit
def _qdot_probe(w_ptr, w2_ptr, x_ptr, out_ptr, stride_w, stride_x, K: tl.constexpr, FMT: tl.constexpr,
                ADT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, PAIR: tl.constexpr):
    """out[0] = x . w and out[1] = x . w2 ([BN, 16] tiles), by two qdot calls or (PAIR) one qdot_pair."""
    n = tl.arange(0, BN)
    m = tl.arange(0, 16)
    w_row = w_ptr + n.to(tl.int64) * stride_w
    w2_row = w2_ptr + n.to(tl.int64) * stride_w
    x_row = x_ptr + m.to(tl.int64) * stride_x
    zero = tl.zeros((BN, 16), dtype=tl.float32)
    if PAIR:
        a, b = qdot_pair(zero, zero, w_row, w2_row, x_row, 0, K, FMT, ADT, G, K)
    else:
        a = qdot(zero, w_row, x_row, 0, K, FMT, ADT, G, K)
        b = qdot(zero, w2_row, x_row, 0, K, FMT, ADT, G, K)
    o = out_ptr + n[:, None] * 16 + m[None, :]
    tl.store(o, a)
    tl.store(o + BN * 16, b)


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_qdot_pair_is_two_qdots_bitwise(qtype, adt):
    """The MoE gate/up kernel's interleaved loop (qdot_pair) gives each weight exactly qdot's bits; control:
    a pair whose second weight differs in one block changes only the second result."""
    from ds4t.backend import tl_dtype

    K, BN = 512, 32
    w, w2 = (random_blocks((BN, K), qtype, seed, exp=(-3, -2)) for seed in (31, 32))
    x = _x(16, K, 33)
    code, G = FORMATS[qtype].code, (4 if qtype in BLOCKS_32 else 1)

    def run(a, b, pair):
        out = poisoned((2, BN, 16), device=DEV)
        _qdot_probe[(1,)](a.data, b.data, x, out, a.data.stride(0), x.stride(0), K=K, FMT=code, ADT=tl_dtype(adt),
                          G=G, BN=BN, PAIR=pair)
        return out

    two, pair = run(w, w2, False), run(w, w2, True)
    assert not torch.isnan(pair).any() and torch.equal(two, pair)
    w3 = random_blocks((BN, K), qtype, 34, exp=(-3, -2))
    other = run(w, w3, True)
    assert torch.equal(other[0], pair[0]) and not torch.equal(other[1], pair[1])
