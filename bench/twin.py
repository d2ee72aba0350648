"""The non-invariant twin of ds4t's kernels: the same model step with each op swapped for a fast
plain-torch implementation that need not be batch invariant, to measure the price of invariance.

A benchmark helper, not library API (ds4t's contract is the invariant kernels). The twin ops:

* GEMMs: cuBLAS ``F.linear`` / ``torch.bmm`` in the weight dtype (activations rounded to it, bf16
  outputs; cuBLAS picks split-K and tiles by batch size: not invariant);
* GQA decode attention: FlashAttention's varlen kernel (``aten._flash_attention_forward``, the rows'
  used lengths as ``seqused_k``: flash-decoding, KV splits chosen by batch size) where it runs, else
  ``F.scaled_dot_product_attention`` over the rows' slot caches, the Hq / Hkv query heads of a kv
  head as SDPA's query length (no KV repeat), a [B, 1, 1, L] mask for the lengths
  (:data:`ATTENTION_IMPL`; :data:`ATTN_CHOICE` records what ran);
  MLA: cuBLAS batched GEMMs over the latent rows (one kv head, q = [q_latent | q_pe]) around an
  fp32 softmax;
* MoE: the pairs sorted by expert and ``F.grouped_mm`` over the stacked experts (device offsets,
  only the chosen experts' weights are read; what transformers' ``grouped_mm`` experts do), or
  gathered expert weights and ``bmm`` where grouped_mm is not available (CPU tests, fp32);
* routers: softmax / sigmoid + ``torch.topk``; norms: ``F.rms_norm`` in fp32; elementwise ops, RoPE
  (``rope_ref``), cache writes (``index_put``), conv and Gated DeltaNet steps (``bmm`` on the state).

Every twin op is graph-safe (no ``.item()``, no host sync, shapes from shapes only), so the bench
captures twin steps in CUDA graphs (``ds4t.batch.graphs.capture_overrides``). Ops that a decode step
does not call (prefill chunks, sampling) keep the ds4t kernel; so does an op given quantized
(FP8 / GGUF) weights: :data:`KEPT` and :func:`applied`'s report say which.

Slot caches: a row reads its session's slot, so by default the twin gathers the rows' slots
(``index_select``: a copy of each row's cache, as a paged-cache-less torch model would). With
``slots_are_rows=True`` (the bench, whose sessions occupy slots 0..B-1 in batch order, as HF's static
cache lays rows out) it uses views of the first B slots instead: no copy. That promise is checked on
every eager call (a host sync; skipped while a CUDA graph is being captured).

Inside :func:`shadowed`, every op runs both ways on the same inputs and the per-op error is
recorded (tests/test_bench_twin.py on the tiny presets; the bench's per-op table on the GPU).
The twin's sets (:data:`SETS`): "all" (every op above) and "priced" (only the ops whose algorithm
invariance constrains: :data:`PRICED`; the row-local ops keep ds4t's kernels, invariant for free).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ds4t.kernels import registry
from ds4t.kernels.rope import rope_ref
from ds4t.kernels.linear_router import ROUTER_OPS, router_args
from ds4t.kernels.router import DROPPED_SCORE

PRICED = ("linear", "linear_heads", "linear_add_rms_norm", "linear_router", "linear_conv1d_update",
          "decode_attention", "mla_decode", "moe_experts", "moe_add_rms_norm")
"""The ops whose algorithm batch invariance constrains (tile / split-K / split-KV / expert grouping
choices fixed regardless of B). The others are row-local: the ds4t kernel is invariant for free."""

KEPT = {
    "conv1d_prefill": "prefill only (the bench fills sessions before the twin is applied)",
    "gdn_prefill": "prefill only",
    "conv1d_prefill_segments": "prefill only (several sessions' chunks in one launch)",
    "gdn_prefill_segments": "prefill only (several sessions' chunks in one launch)",
    "argmax": "sampling, not part of a forward step",
    "sample": "sampling, not part of a forward step",
}
"""Registered ops the twin leaves to ds4t's kernel, with why."""

MOE_IMPL = "auto"
"""``"auto"``: F.grouped_mm where it runs (bf16 on a GPU; any float on the CPU), else gathered
weights + bmm; ``"grouped_mm"`` / ``"gather"`` force one (tests)."""


@dataclasses.dataclass
class _State:
    slots_are_rows: bool = False


_STATE = _State()


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _ds4t(name: str) -> Callable:
    """The ds4t launcher of op ``name`` (not its override): the twin's fallback."""
    return registry.op(name).fn


def _plain(*ws) -> bool:
    """Float tensors (not FP8 / GGUF block weights, which the twin leaves to ds4t)."""
    return all(type(w) is torch.Tensor and w.dtype.is_floating_point for w in ws)


def _out(y: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 result (contiguous, as the kernels return theirs: callers take .view()s of it), written
    into ``out`` when the caller passed one."""
    if out is None:
        return y.float().contiguous()
    out.copy_(y)
    return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _rows(state: torch.Tensor, slots: torch.Tensor, B: int) -> torch.Tensor:
    """The B rows' slot entries of a pool tensor [S, ...] -> [B, ...]: a view of slots 0..B-1 when
    ``slots_are_rows`` (checked outside graph capture), else a gather (a copy)."""
    if _STATE.slots_are_rows:
        if not _capturing() and not torch.equal(slots.long(), torch.arange(B, device=slots.device)):
            raise ValueError("twin: slots_are_rows was promised, but this batch's slots are not 0..B-1")
        return state[:B]
    return state.index_select(0, slots.long())


def _write_rows(state: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """state[slots[b]] = new[b] (new [B, ...]); in place. A no-op when ``new`` already is the view."""
    B = new.shape[0]
    if _STATE.slots_are_rows:
        dst = state[:B]
        if dst.data_ptr() != new.data_ptr():
            dst.copy_(new)
    else:
        state.index_copy_(0, slots.long(), new.to(state.dtype))


def _length_mask(lengths: torch.Tensor, L: int) -> torch.Tensor:
    """bool [B, 1, 1, L]: cache position < lengths[b] (broadcast over heads and query rows)."""
    pos = torch.arange(L, device=lengths.device)
    return (pos[None, :] < lengths.long()[:, None])[:, None, None, :]


# ----------------------------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------------------------
def linear(x, weight, bias=None, *, out=None, config=None, act_dtype=None):
    """cuBLAS: x rounded to the weight dtype, ``F.linear`` (output in the weight dtype), fp32 result."""
    if not _plain(weight) or (act_dtype is not None and act_dtype != weight.dtype):
        return _ds4t("linear")(x, weight, bias, out=out, config=config, act_dtype=act_dtype)
    b = None if bias is None else bias.to(weight.dtype)
    return _out(F.linear(x.to(weight.dtype), weight, b), out)


def linear_heads(x, weight, *, out=None, act_dtype=None):
    """x [B, G, K], weight [G, N, K] -> fp32 [B, G, N]: one strided batched GEMM over the heads."""
    if not _plain(weight) or (act_dtype is not None and act_dtype != weight.dtype):
        return _ds4t("linear_heads")(x, weight, out=out, act_dtype=act_dtype)
    y = torch.bmm(x.transpose(0, 1).to(weight.dtype), weight.transpose(1, 2))   # [G, B, N]
    return _out(y.transpose(0, 1), out)


# ----------------------------------------------------------------------------------------------
# norms, elementwise, embedding, RoPE
# ----------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps, *, zero_centered=False, out=None, out_dtype=torch.float32):
    """``F.rms_norm`` in fp32 (stored as ``out_dtype``); x̂·(1 + w) when ``zero_centered``."""
    w = weight.float()
    y = F.rms_norm(x.float(), (x.shape[-1],), 1.0 + w if zero_centered else w, eps).to(out_dtype)
    return _out(y, out)


def add_rms_norm(x, residual, weight, eps, *, zero_centered=False, out_dtype=torch.float32):
    s = x.float() + residual.float()
    return rms_norm(s, weight, eps, zero_centered=zero_centered, out_dtype=out_dtype), s


def linear_add_rms_norm(x, weight, residual, norm_weight, eps, *, bias=None, zero_centered=False,
                        out_dtype=torch.float32):
    """:func:`linear` (cuBLAS) then :func:`add_rms_norm`: two calls, as the op is when not fused."""
    return add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps, zero_centered=zero_centered,
                        out_dtype=out_dtype)


def gated_rms_norm(x, z, weight, eps, *, out=None, out_dtype=torch.float32):
    return _out((rms_norm(x, weight, eps) * F.silu(z.reshape(x.shape).float())).to(out_dtype), out)


def silu_mul(gate, up, *, out=None):
    return _out(F.silu(gate.float()) * up.float(), out)


def sigmoid_mul(x, gate, *, out=None):
    return _out(x.float() * torch.sigmoid(gate.float()), out)


def add(a, b, *, out=None):
    return _out(a.float() + b.float(), out)


def embedding(ids, table, *, out=None):
    return _out(F.embedding(ids.long(), table), out)


def rope(x, positions, inv_freq, *, rotary_dim=None, interleaved=False, scale=1.0, out=None):
    """ds4t's plain-torch RoPE (rotate-half or interleaved, HF's formula)."""
    return rope_ref(x, positions, inv_freq, rotary_dim=rotary_dim, interleaved=interleaved, scale=scale, out=out)


# ----------------------------------------------------------------------------------------------
# attention and caches
# ----------------------------------------------------------------------------------------------
def write_kv(k, v, k_cache, v_cache, slots, positions):
    """``index_put``: cache[slots[b], positions[b]] = k[b] (rounded to the cache dtype)."""
    s, p = slots.long(), positions.long()
    k_cache[s, p] = k.to(k_cache.dtype)
    v_cache[s, p] = v.to(v_cache.dtype)


ATTENTION_IMPL = "auto"
"""GQA decode attention: ``"auto"`` tries, on a GPU, FlashAttention's varlen kernel
(``aten._flash_attention_forward`` with the rows' used lengths ``seqused_k``: the rows' caches read in
place, KV split across blocks by its own batch-size heuristic, i.e. flash-decoding), then
``F.scaled_dot_product_attention`` with a length mask on a fused backend, then SDPA's math path;
``"sdpa"`` skips the flash kernel (what the brief's SDPA baseline is)."""

ATTN_CHOICE: Dict[tuple, str] = {}
"""Per attention call shape: the implementation that ran ("flash varlen", "sdpa fused", "sdpa math").
Decided on the first (eager) call of a shape by trying them in order; a CUDA graph capture always
follows an eager step of the same shape, so no trial happens while capturing."""


def _has_seqused_k() -> bool:
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "seqused_k" for a in schema.arguments)


def _flash_varlen(q, k, v, lengths, scale):
    """q [B, Hq, D]; k / v [B, L, Hkv, D] (contiguous rows: a free [B·L, Hkv, D] view); row b attends to
    its first lengths[b] positions. -> [B, Hq, Dv] in the cache dtype."""
    B, L, Hkv, D = k.shape
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return torch.ops.aten._flash_attention_forward(
        q.to(k.dtype).contiguous(), k.reshape(B * L, Hkv, D), v.reshape(B * L, Hkv, v.shape[-1]), cu, cu * L, 1, L,
        0.0, False, False, scale=scale, seqused_k=lengths.to(torch.int32))[0]


def _sdpa(q, k, v, lengths, scale):
    """SDPA: q [B, Hq, D] as [B, Hkv, G, D] (the G = Hq / Hkv query heads of a kv head as its query rows:
    GQA without repeating K/V), k / v [B, L, Hkv, D] as [B, Hkv, L, D] views, a [B, 1, 1, L] length mask."""
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    o = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D).to(k.dtype), k.transpose(1, 2),
                                       v.transpose(1, 2), attn_mask=_length_mask(lengths, L), scale=scale)
    return o.reshape(B, Hq, v.shape[-1])


def _sdpa_fused(q, k, v, lengths, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        return _sdpa(q, k, v, lengths, scale)


_ATTN = {"flash varlen": _flash_varlen, "sdpa fused": _sdpa_fused, "sdpa math": _sdpa}


def _attend(q, k, v, lengths, scale):
    """[B, Hq, Dv] attention of each row over its cache rows k / v [B, L, Hkv, D] (see ATTENTION_IMPL)."""
    key = (tuple(q.shape), tuple(k.shape), v.shape[-1], k.dtype)
    choice = ATTN_CHOICE.get(key)
    if choice is not None:
        return _ATTN[choice](q, k, v, lengths, scale)
    names = ["sdpa math"]   # off the GPU: SDPA's own pick
    if q.device.type == "cuda":
        names = ["sdpa fused", "sdpa math"]
        if (ATTENTION_IMPL == "auto" and k.dtype in (torch.bfloat16, torch.float16)
                and k.shape[-1] == v.shape[-1] <= 256 and _has_seqused_k()):
            names.insert(0, "flash varlen")
    for name in names:
        try:
            o = _ATTN[name](q, k, v, lengths, scale)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            if name == names[-1]:
                raise
            continue
        ATTN_CHOICE[key] = name
        return o
    raise AssertionError("unreachable")


def decode_attention(q, k_cache, v_cache, slots, lengths, scale, *, split_size=None, out=None, gate=None):
    """Each row over its slot's cache (views of slots 0..B-1 with slots_are_rows, else gathered rows),
    positions < lengths[b]: FlashAttention varlen or SDPA (:data:`ATTENTION_IMPL`), in the cache
    dtype; fp32 [B, Hq, Dv] (× sigmoid(gate) when given)."""
    B, Hq, _ = q.shape
    Dv = v_cache.shape[3]
    o = _attend(q, _rows(k_cache, slots, B), _rows(v_cache, slots, B), lengths, scale).float()
    if gate is not None:
        o = o * torch.sigmoid(gate.float()).view(B, Hq, Dv)
    return _out(o, out)


def norm_rope_write_kv(q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache, v_cache, slots, *,
                       rotary_dim=None, zero_centered=False, out=None):
    """Per-head RMSNorm of q and k, RoPE, k/v into the caches; returns q fp32 [R, H, D]."""
    R, H, D = q.shape
    KV = k.shape[1]
    qn = rms_norm(q.reshape(R * H, D), q_norm, eps, zero_centered=zero_centered).view(R, H, D)
    kn = rms_norm(k.reshape(R * KV, D), k_norm, eps, zero_centered=zero_centered).view(R, KV, D)
    kr = rope_ref(kn, positions, inv_freq, rotary_dim=rotary_dim)
    write_kv(kr, v, k_cache, v_cache, slots, positions)
    return rope_ref(qn, positions, inv_freq, rotary_dim=rotary_dim, out=out)


def write_latent(c_kv, k_pe, cache, slots, positions):
    cache[slots.long(), positions.long()] = torch.cat([c_kv.float(), k_pe.float()], dim=-1).to(cache.dtype)


def norm_rope_write_latent(c_kv, kv_norm, eps, q_pe, k_pe, positions, inv_freq, cache, slots, *, interleaved=False,
                           scale=1.0, out=None):
    """MLA's prologue: kv_a RMSNorm, RoPE on k_pe into the latent row written to the cache; returns RoPE(q_pe)
    fp32 [R, H, Dr]."""
    k = rope_ref(k_pe[:, None], positions, inv_freq, interleaved=interleaved, scale=scale)[:, 0]
    write_latent(rms_norm(c_kv, kv_norm, eps), k, cache, slots, positions)
    return rope_ref(q_pe, positions, inv_freq, interleaved=interleaved, scale=scale, out=out)


def mla_decode(q_latent, q_pe, cache, slots, lengths, scale, *, kv_lora_rank, split_size=None, out=None):
    """Absorbed MLA (one kv head: the latent rows) as two cuBLAS batched GEMMs in the cache dtype
    around an fp32 softmax: scores = [q_latent | q_pe] · rows^T [B, H, L], p · rows[..., :R]; fp32
    [B, H, R]. (Not SDPA: no fused SDPA kernel takes 576-wide heads, and its math path copies the
    cache to fp32.) The rows are read in place (batch stride L·(R + Dr), no copy) with slots_are_rows."""
    B, H, R = q_latent.shape
    L = cache.shape[1]
    kv = _rows(cache, slots, B)                                           # [B, L, R + Dr]
    q = torch.cat([q_latent.to(cache.dtype), q_pe.to(cache.dtype)], dim=-1)
    sc = torch.bmm(q, kv.transpose(1, 2)).float() * scale                # [B, H, L]
    sc = sc.masked_fill(~_length_mask(lengths, L)[:, 0], float("-inf"))
    p = torch.softmax(sc, dim=-1).to(cache.dtype)
    return _out(torch.bmm(p, kv[..., :R]), out)


# ----------------------------------------------------------------------------------------------
# recurrent state (Qwen3-Next)
# ----------------------------------------------------------------------------------------------
def linear_conv1d_update(x, weight, conv_state, conv_weight, slots, *, bias=None, conv_bias=None, silu=True):
    """:func:`linear` (cuBLAS) then :func:`conv1d_update` on its first C columns: two calls, as the op is when
    not fused."""
    y = linear(x, weight, bias)
    return conv1d_update(y[:, :conv_weight.shape[0]], conv_state, conv_weight, slots, bias=conv_bias, silu=silu), y


def conv1d_update(x, conv_state, weight, slots, *, bias=None, silu=True, out=None):
    """Depthwise causal conv step: [history | x] · w per channel, the history shifted in place."""
    B = x.shape[0]
    inp = torch.cat([_rows(conv_state, slots, B), x.float()[:, :, None]], dim=-1)   # [B, C, W]
    acc = (inp * weight.float()).sum(-1)
    if bias is not None:
        acc = acc + bias.float()
    if silu:
        acc = F.silu(acc)
    _write_rows(conv_state, slots, inp[:, :, 1:])
    return _out(acc, out)


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, *, out=None, z=None, norm_w=None, norm_eps=1e-6):
    """Gated delta rule step on the state with batched GEMMs: S *= exp(g); S += k (x) beta(v - S^T k);
    o = S^T q (then the gated RMSNorm with z); the state updated in place (or gathered and written back)."""
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    n = B * Hv
    qf = _l2norm(q.float().repeat_interleave(Hv // Hk, dim=1)) * Dk ** -0.5
    kf = _l2norm(k.float().repeat_interleave(Hv // Hk, dim=1))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())      # [B, Hv]
    beta = torch.sigmoid(b.float())
    rows = _rows(state, slots, B)                                         # [B, Hv, Dk, Dv]
    S = rows.view(n, Dk, Dv)
    S.mul_(g.exp().reshape(n, 1, 1))
    kv = torch.bmm(kf.reshape(n, 1, Dk), S)                               # [n, 1, Dv]
    delta = (v.float().reshape(n, 1, Dv) - kv) * beta.reshape(n, 1, 1)
    S.baddbmm_(kf.reshape(n, Dk, 1), delta)
    o = torch.bmm(qf.reshape(n, 1, Dk), S).view(B, Hv, Dv)
    _write_rows(state, slots, rows)
    if z is not None:
        o = gated_rms_norm(o.reshape(n, Dv), z.reshape(n, Dv), norm_w, norm_eps).view(B, Hv, Dv)
    return _out(o, out)


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------
def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped(x: torch.Tensor) -> bool:
    if MOE_IMPL != "auto":
        return MOE_IMPL == "grouped_mm"
    return _grouped_mm_fn() is not None and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def _experts_grouped(x, ids, w_gate, w_up, w_down):
    """Pairs sorted by expert, one grouped GEMM per projection over the stacked experts [E, N, K]
    (offsets on the device); y [P, D] back in pair order (P = B * KT)."""
    KT = ids.shape[1]
    gmm = _grouped_mm_fn()
    flat = ids.reshape(-1)
    e_sorted, perm = torch.sort(flat)
    xs = x.index_select(0, perm // KT)
    offs = torch.searchsorted(e_sorted, torch.arange(w_gate.shape[0], device=x.device), right=True).to(torch.int32)
    g = gmm(xs, w_gate.transpose(-2, -1), offs=offs)
    u = gmm(xs, w_up.transpose(-2, -1), offs=offs)
    act = (F.silu(g.float()) * u.float()).to(x.dtype)
    yd = gmm(act, w_down.transpose(-2, -1), offs=offs)
    return torch.empty_like(yd).index_copy_(0, perm, yd)


def _experts_gathered(x, ids, w_gate, w_up, w_down):
    """Each pair's expert weights gathered ([P, N, K] copies) and one bmm per projection."""
    KT = ids.shape[1]
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(KT, dim=0)[:, :, None]                        # [P, D, 1]
    g = torch.bmm(w_gate.index_select(0, flat), xs)[..., 0]
    u = torch.bmm(w_up.index_select(0, flat), xs)[..., 0]
    act = (F.silu(g.float()) * u.float()).to(x.dtype)[:, :, None]
    return torch.bmm(w_down.index_select(0, flat), act)[..., 0]


def moe_experts(h, ids, weights, w_gate, w_up, w_down, *, shared_expert=None, shared_gate=None, out=None,
                act_dtype=None):
    """Routed SwiGLU experts (+ the stacked shared expert as an extra rank): grouped GEMMs in the
    weight dtype, the ranks summed in fp32. ids of -1 add 0, as in ds4t."""
    if not _plain(w_gate, w_up, w_down) or (act_dtype is not None and act_dtype != w_gate.dtype):
        return _ds4t("moe_experts")(h, ids, weights, w_gate, w_up, w_down, shared_expert=shared_expert,
                                    shared_gate=shared_gate, out=out, act_dtype=act_dtype)
    B, D = h.shape
    idx, wts = ids.long(), weights.float()
    if shared_expert is not None:
        idx = torch.cat([idx, torch.full((B, 1), int(shared_expert), dtype=torch.long, device=h.device)], 1)
        sw = (torch.sigmoid(shared_gate.float()) if shared_gate is not None
              else torch.ones(B, dtype=torch.float32, device=h.device))
        wts = torch.cat([wts, sw[:, None]], 1)
    KT = idx.shape[1]
    if KT == 0:
        return _out(torch.zeros((B, D), dtype=torch.float32, device=h.device), out)
    wts = torch.where(idx >= 0, wts, torch.zeros_like(wts))
    idx = idx.clamp(min=0)
    x = h.to(w_gate.dtype)
    run = _experts_grouped if _use_grouped(x) else _experts_gathered
    y = run(x, idx, w_gate, w_up, w_down)
    return _out((y.view(B, KT, D).float() * wts[:, :, None]).sum(1), out)


def moe_add_rms_norm(h, ids, weights, w_gate, w_up, w_down, residual, norm_weight, eps, *, shared_expert=None,
                     shared_gate=None, zero_centered=False, out_dtype=torch.float32):
    """:func:`moe_experts` (grouped GEMMs) then :func:`add_rms_norm`: two calls, as the op is when not fused."""
    y = moe_experts(h, ids, weights, w_gate, w_up, w_down, shared_expert=shared_expert, shared_gate=shared_gate)
    return add_rms_norm(y, residual, norm_weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------
# routers
# ----------------------------------------------------------------------------------------------
def _ret(w, ids, out):
    if out is not None:
        out[0].copy_(w)
        out[1].copy_(ids)
        return out
    return w, ids.to(torch.int32)


def router_softmax_topk(logits, top_k, renormalize, *, out=None):
    p = torch.softmax(logits.float(), dim=-1)
    w, i = torch.topk(p, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return _ret(w, i, out)


def router_sigmoid_grouped(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling, *,
                           dropped=DROPPED_SCORE, out=None):
    """noaux_tc: sigmoid scores, the topk_group best groups (sum of each group's 2 best biased scores),
    top-k of the biased scores there, weights = unbiased scores (renormalised) × scaling."""
    B, E = logits.shape
    s = torch.sigmoid(logits.float())
    sel = s + correction_bias.float()
    if topk_group < n_group:
        grp = sel.view(B, n_group, E // n_group)
        gscore = grp.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep[:, :, None].expand(B, n_group, E // n_group).reshape(B, E), dropped)
    ids = sel.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return _ret(w * scaling, ids, out)


def linear_router(x, weight, num_experts, kind, top_k, renormalize, *, bias=None, correction_bias=None, n_group=1,
                  topk_group=1, scaling=1.0):
    """:func:`linear` (cuBLAS) then the router twin: two calls, as the op is when not fused."""
    logits = linear(x, weight, bias)
    args = router_args(kind, top_k, renormalize, correction_bias, n_group, topk_group, scaling)
    w, ids = TWIN[ROUTER_OPS[kind]](logits[:, :num_experts], *args)
    return w, ids, logits


# ----------------------------------------------------------------------------------------------
# applying the twin
# ----------------------------------------------------------------------------------------------
TWIN: Dict[str, Callable] = {f.__name__: f for f in (
    linear, linear_heads, linear_add_rms_norm, rms_norm, add_rms_norm, gated_rms_norm,
    silu_mul, sigmoid_mul, add, embedding, rope,
    write_kv, decode_attention, norm_rope_write_kv, write_latent, norm_rope_write_latent, mla_decode,
    conv1d_update, linear_conv1d_update, gdn_decode, moe_experts, moe_add_rms_norm, router_softmax_topk,
    router_sigmoid_grouped, linear_router)}
"""op name -> its twin (same signature as the ds4t launcher)."""

SETS = {"all": tuple(sorted(TWIN)), "priced": PRICED}
"""Named op selections for :func:`applied`: every twin op, or only the ops invariance constrains."""


@dataclasses.dataclass
class TwinReport:
    swapped: List[str]                 # ops that run the twin
    kept: Dict[str, str]               # op -> why it runs the ds4t kernel

    def describe(self) -> str:
        kept = "; ".join(f"{k} ({why})" for k, why in sorted(self.kept.items()))
        return f"swapped to plain torch: {', '.join(self.swapped)}. ds4t kernel kept: {kept or 'none'}"


def resolve(selection) -> List[str]:
    """A set name ("all", "priced"), a comma list of op names, or a sequence of them -> op names."""
    if isinstance(selection, str):
        selection = SETS.get(selection) or [s.strip() for s in selection.split(",") if s.strip()]
    names = list(dict.fromkeys(selection))
    bad = [n for n in names if n not in TWIN]
    if bad:
        raise ValueError(f"no twin for op(s) {bad}; twins exist for {sorted(TWIN)}")
    return names


@contextlib.contextmanager
def applied(selection="all", *, slots_are_rows: bool = False) -> Iterator[TwinReport]:
    """Override the selected ops with their twins (registry overrides) inside the block; yields the
    report of what is swapped and what keeps ds4t's kernel. To replay twin steps as CUDA graphs,
    also enter ``ds4t.batch.graphs.capture_overrides()``."""
    names = resolve(selection)
    kept = {n: KEPT.get(n, "not selected") for n in registry.op_names() if n not in names}
    prev = _STATE.slots_are_rows
    _STATE.slots_are_rows = slots_are_rows
    handles = [registry.override(n, TWIN[n]) for n in names]
    try:
        yield TwinReport(sorted(names), kept)
    finally:
        for h in reversed(handles):
            h.restore()
        _STATE.slots_are_rows = prev


# ----------------------------------------------------------------------------------------------
# per-op comparison with the ds4t kernels
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OpDiff:
    """One op over a shadowed step: calls, the largest relative error of its outputs and of the
    tensors it wrote in place (max |twin - ds4t| / max |ds4t|, per tensor), integer outputs that differ."""
    calls: int = 0
    max_rel: float = 0.0
    int_mismatches: int = 0


def _clone(obj, memo: dict):
    """Copies of the tensors in ``obj``; one tensor passed twice (``rope(x, ..., out=x)``) gets one copy."""
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), tuple(obj.shape), obj.stride(), obj.dtype)
        if key not in memo:
            memo[key] = obj.clone()
        return memo[key]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(o, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: _clone(v, memo) for k, v in obj.items()}
    return obj


def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _compare(d: OpDiff, ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor], chunk: int = 1 << 24) -> None:
    # In chunks: in-place arguments include whole cache pools (GBs); a float copy of one would not fit.
    for a, b in zip(ref, got):
        a, b = a.reshape(-1), b.reshape(-1)
        if a.dtype.is_floating_point:
            scale = err = 0.0
            for i in range(0, a.numel(), chunk):
                x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
                scale = max(scale, x.abs().max().item())
                err = max(err, (x - y).abs().max().item())
            d.max_rel = max(d.max_rel, err / scale if scale > 0 else err)
        else:
            d.int_mismatches += sum(int((a[i:i + chunk] != b[i:i + chunk]).sum().item())
                                    for i in range(0, a.numel(), chunk))


@contextlib.contextmanager
def shadowed(selection="all") -> Iterator[Dict[str, OpDiff]]:
    """Inside the block every selected op runs ds4t's kernel on its arguments (the step goes on with
    those results) and the twin on copies of them; the yielded dict fills with each op's
    :class:`OpDiff` (outputs and in-place writes compared). Eager only: it syncs with the host."""
    diffs: Dict[str, OpDiff] = {}

    def make(name):
        fn, twin = _ds4t(name), TWIN[name]

        def shadow(*args, **kwargs):
            memo = {}
            cargs, ckw = _clone(args, memo), _clone(kwargs, memo)
            ref = fn(*args, **kwargs)
            got = registry.call_override(name, twin, *cargs, **ckw)   # advisory keywords as an override gets them
            d = diffs.setdefault(name, OpDiff())
            d.calls += 1
            _compare(d, _tensors(ref), _tensors(got))
            _compare(d, _tensors((args, kwargs)), _tensors((cargs, ckw)))   # in-place writes
            return ref

        shadow.__name__ = shadow.__qualname__ = f"shadow_{name}"
        return shadow

    handles = [registry.override(n, make(n)) for n in resolve(selection)]
    try:
        yield diffs
    finally:
        for h in reversed(handles):
            h.restore()
