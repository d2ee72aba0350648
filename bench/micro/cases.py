"""Inputs for the kernel micro-benchmarks: one case per kernel op, at two sizes.

``small``: shapes the Triton interpreter runs in milliseconds (like the ``ds4t check`` shapes,
fp32 weights as the tiny presets). ``*_fp8`` cases: the same op with block-scaled FP8 weights. ``real``: one decode step of 16 sessions at real layer
dimensions (Qwen3-Next-80B-A3B, DeepSeek-V3; bf16 weights and caches), for a GPU.
``make(device, real)`` builds the inputs once and returns the zero-argument call to time.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Dict

import torch

import ds4t  # noqa: F401  (selects the backend before triton is imported)
from ds4t.kernels import (activation, attention, conv, embedding, gdn, linear, linear_conv, linear_norm, linear_router,
                          mla, moe, moe_norm, norm, rope, router, sampling)
from ds4t.kernels.weights import quantize

B = 16   # decode rows at the real size (sessions in one step)


def micro_size() -> str:
    """``DS4T_MICRO_SIZE``: small (default in the interpreter) or real (default on a GPU)."""
    from ds4t.backend import INTERPRET

    size = os.environ.get("DS4T_MICRO_SIZE", "small" if INTERPRET else "real")
    if size not in ("small", "real"):
        raise ValueError(f"DS4T_MICRO_SIZE={size!r}: use small or real")
    return size


def _rand(device, *shape, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _wdt(real):
    return torch.bfloat16 if real else torch.float32


def _ints(device, values, dtype=torch.int32):
    return torch.as_tensor(values, dtype=dtype, device=device)


def _linear(dev, real):
    b, K, N = (B, 2048, 12288) if real else (5, 200, 333)
    x, w = _rand(dev, b, K), _rand(dev, N, K, scale=K ** -0.5, dtype=_wdt(real))
    return lambda: linear.linear(x, w)


def _linear_heads(dev, real):   # DeepSeek-V3 absorbed q_nope -> latent: 128 heads, 128 -> 512
    b, H, K, N = (B, 128, 128, 512) if real else (5, 3, 40, 24)
    x, w = _rand(dev, b, H, K), _rand(dev, H, N, K, scale=K ** -0.5, dtype=_wdt(real))
    return lambda: linear.linear_heads(x, w)


def _linear_fp8(dev, real):
    """FP8 weights (W8A16, 128x128 blocks). Real: DeepSeek-V3's dense MLP gate (7168 -> 18432,
    132 MB of fp8 + 4 MB of scales), activations rounded to bf16 as a bf16 model's; small: fp32."""
    b, K, N = (B, 7168, 18432) if real else (5, 200, 333)
    x, w = _rand(dev, b, K), quantize(_rand(dev, N, K, scale=K ** -0.5))
    adt = torch.bfloat16 if real else torch.float32
    return lambda: linear.linear(x, w, act_dtype=adt)


def _linear_heads_fp8(dev, real):
    b, H, K, N = (B, 128, 128, 512) if real else (5, 3, 40, 24)
    x, w = _rand(dev, b, H, K), quantize(_rand(dev, H, N, K, scale=K ** -0.5))
    adt = torch.bfloat16 if real else torch.float32
    return lambda: linear.linear_heads(x, w, act_dtype=adt)


def _norm_inputs(dev, real):
    R, D = (B, 2048) if real else (6, 333)
    return _rand(dev, R, D), _rand(dev, R, D, seed=1), 1 + _rand(dev, D, scale=0.1, seed=2)


def _rms_norm(dev, real):
    x, _, w = _norm_inputs(dev, real)
    return lambda: norm.rms_norm(x, w, 1e-6)


def _add_rms_norm(dev, real):
    x, r, w = _norm_inputs(dev, real)
    return lambda: norm.add_rms_norm(x, r, w, 1e-6)


def _linear_add_rms_norm(dev, real):   # Qwen3-Next's out_proj (4096 -> 2048, split K) and the norm after it
    b, K, N = (B, 4096, 2048) if real else (5, 200, 96)
    x, w = _rand(dev, b, K), _rand(dev, N, K, scale=K ** -0.5, dtype=_wdt(real))
    r, nw = _rand(dev, b, N, seed=1), 1 + _rand(dev, N, scale=0.1, seed=2)
    return lambda: linear_norm.linear_add_rms_norm(x, w, r, nw, 1e-6)


def _gated_rms_norm(dev, real):   # the GDN output norm: one row per (session, value head)
    R, D = (B * 32, 128) if real else (12, 24)
    x, z, w = _rand(dev, R, D), _rand(dev, R, D, seed=1), 1 + _rand(dev, D, scale=0.1, seed=2)
    return lambda: norm.gated_rms_norm(x, z, w, 1e-6)


def _binary(op):
    def make(dev, real):
        R, C = (B, 5120) if real else (7, 333)
        a, b = _rand(dev, R, C), _rand(dev, R, C, seed=1)
        return lambda: op(a, b)
    return make


def _embedding(dev, real):
    V, D = (151936, 2048) if real else (100, 333)
    table = _rand(dev, V, D, dtype=_wdt(real))
    ids = torch.randint(0, V, (B if real else 9,), generator=torch.Generator().manual_seed(0)).to(dev)
    return lambda: embedding.embedding(ids, table)


def _rope(dev, real):
    b, H, D, R = (B, 16, 256, 64) if real else (5, 6, 80, 40)
    x = _rand(dev, b, H, D)
    pos = torch.arange(b, dtype=torch.int64, device=dev) * 37
    inv = rope.default_inv_freq(R, 10000.0, device=dev)
    return lambda: rope.rope(x, pos, inv)


def _kv_dims(real):   # slots, capacity, q heads, kv heads, head dim
    return (B, 4096, 16, 2, 256) if real else (4, 48, 6, 2, 48)


def _decode_attention(dev, real):
    S, L, HQ, HKV, D = _kv_dims(real)
    kc, vc = _rand(dev, S, L, HKV, D, dtype=_wdt(real)), _rand(dev, S, L, HKV, D, dtype=_wdt(real), seed=1)
    q = _rand(dev, S, HQ, D, seed=2)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    lengths = torch.full((S,), L, dtype=torch.int32, device=dev)
    return lambda: attention.decode_attention(q, kc, vc, slots, lengths, D ** -0.5)


def _write_kv(dev, real):
    S, L, _, HKV, D = _kv_dims(real)
    kc, vc = _rand(dev, S, L, HKV, D, dtype=_wdt(real)), _rand(dev, S, L, HKV, D, dtype=_wdt(real), seed=1)
    k, v = _rand(dev, S, HKV, D, seed=2), _rand(dev, S, HKV, D, seed=3)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    pos = torch.full((S,), L // 2, dtype=torch.int32, device=dev)
    return lambda: attention.write_kv(k, v, kc, vc, slots, pos)


def _norm_rope_write_kv(dev, real):
    S, L, HQ, HKV, D = _kv_dims(real)
    kc, vc = _rand(dev, S, L, HKV, D, dtype=_wdt(real)), _rand(dev, S, L, HKV, D, dtype=_wdt(real), seed=1)
    q, k, v = _rand(dev, S, HQ, D, seed=2), _rand(dev, S, HKV, D, seed=3), _rand(dev, S, HKV, D, seed=4)
    qn, kn = _rand(dev, D, scale=0.1, seed=5), _rand(dev, D, scale=0.1, seed=6)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    pos = torch.full((S,), L // 2, dtype=torch.int32, device=dev)
    inv = rope.default_inv_freq(D // 4, 10000.0, device=dev)
    return lambda: attention.norm_rope_write_kv(q, k, v, qn, kn, 1e-6, pos, inv, kc, vc, slots,
                                                rotary_dim=D // 4, zero_centered=True)


def _conv_inputs(dev, real):
    S, C, W = (B, 8192, 4) if real else (6, 200, 4)
    return S, C, _rand(dev, C, W, scale=0.5, dtype=_wdt(real)), _rand(dev, S, C, W - 1, seed=1)


def _conv1d_update(dev, real):
    S, C, w, state = _conv_inputs(dev, real)
    x = _rand(dev, S, C, seed=2)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    return lambda: conv.conv1d_update(x, state, w, slots)


def _linear_conv1d_update(dev, real):   # Qwen3-Next's GDN in_proj (2048 -> q|k|v|z|b|a, split K) and its conv
    S, C, w, state = _conv_inputs(dev, real)
    K, N = (2048, C + 4096 + 64) if real else (96, C + 24)
    x, wp = _rand(dev, S, K, seed=3), _rand(dev, N, K, scale=K ** -0.5, dtype=_wdt(real), seed=4)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    return lambda: linear_conv.linear_conv1d_update(x, wp, state, w, slots)


def _conv1d_prefill(dev, real):
    S, C, w, state = _conv_inputs(dev, real)
    x = _rand(dev, 128 if real else 7, C, seed=2)
    return lambda: conv.conv1d_prefill(x, state, w, 0)


def _segments(dev, sessions, rows_each):
    """The segments table of ``sessions`` chunks of ``rows_each`` rows, session i in slot i."""
    return torch.tensor([[i * rows_each, rows_each, i, -1] for i in range(sessions)], dtype=torch.int64, device=dev)


def _conv1d_prefill_segments(dev, real):
    S, C, w, state = _conv_inputs(dev, real)
    n, t = (S, 16) if real else (3, 3)
    x = _rand(dev, n * t, C, seed=2)
    segs = _segments(dev, n, t)
    return lambda: conv.conv1d_prefill_segments(x, state, w, segs)


def _gdn_inputs(dev, real, T):
    Hk, Hv, Dk, Dv, S = (16, 32, 128, 128, B) if real else (2, 4, 16, 24, 6)
    q, k = _rand(dev, T, Hk, Dk), _rand(dev, T, Hk, Dk, seed=1)
    v, a, b = _rand(dev, T, Hv, Dv, seed=2), _rand(dev, T, Hv, seed=3), _rand(dev, T, Hv, seed=4)
    A_log, dt_bias = _rand(dev, Hv, scale=0.5, seed=5), _rand(dev, Hv, scale=0.5, seed=6)
    return (q, k, v, a, b, A_log, dt_bias, _rand(dev, S, Hv, Dk, Dv, scale=0.1, seed=7)), S


def _gdn_decode(dev, real):
    args, S = _gdn_inputs(dev, real, B if real else 4)
    slots = torch.arange(args[0].shape[0], dtype=torch.int32, device=dev)
    return lambda: gdn.gdn_decode(*args, slots)


def _gdn_prefill(dev, real):
    args, _ = _gdn_inputs(dev, real, 64 if real else 5)
    return lambda: gdn.gdn_prefill(*args, 0)


def _gdn_prefill_segments(dev, real):
    n, t = (B, 16) if real else (3, 2)
    args, _ = _gdn_inputs(dev, real, n * t)
    segs = _segments(dev, n, t)
    return lambda: gdn.gdn_prefill_segments(*args, segs)


def _mla_dims(real):   # slots, capacity, heads, kv_lora_rank, rope dim
    return (B, 4096, 128, 512, 64) if real else (5, 40, 4, 16, 8)


def _mla_decode(dev, real):
    S, L, H, R, Dr = _mla_dims(real)
    cache = _rand(dev, S, L, R + Dr, dtype=_wdt(real))
    q, qp = _rand(dev, S, H, R, seed=1), _rand(dev, S, H, Dr, seed=2)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    lengths = torch.full((S,), L, dtype=torch.int32, device=dev)
    return lambda: mla.mla_decode(q, qp, cache, slots, lengths, 1 / math.sqrt(192), kv_lora_rank=R)


def _write_latent(dev, real):
    S, L, _, R, Dr = _mla_dims(real)
    cache = _rand(dev, S, L, R + Dr, dtype=_wdt(real))
    c, kp = _rand(dev, S, R, seed=1), _rand(dev, S, Dr, seed=2)
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    pos = torch.full((S,), L // 2, dtype=torch.int32, device=dev)
    return lambda: mla.write_latent(c, kp, cache, slots, pos)


def _norm_rope_write_latent(dev, real):
    S, L, H, R, Dr = _mla_dims(real)
    cache = _rand(dev, S, L, R + Dr, dtype=_wdt(real))
    a = _rand(dev, S, R + Dr, seed=1)
    q_pe, w = _rand(dev, S, H, Dr, seed=2), _rand(dev, R, scale=0.1, seed=3) + 1
    slots = torch.arange(S, dtype=torch.int32, device=dev)
    pos = torch.full((S,), L // 2, dtype=torch.int32, device=dev)
    inv = rope.default_inv_freq(Dr, 10000.0, device=dev)
    return lambda: mla.norm_rope_write_latent(a[:, :R], w, 1e-6, q_pe, a[:, R:], pos, inv, cache, slots,
                                              interleaved=True)


def _moe_experts(dev, real):
    b, E, k, D, I = (B, 512, 10, 2048, 512) if real else (6, 10, 3, 48, 40)
    g = torch.Generator().manual_seed(0)
    h = _rand(dev, b, D)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b)]).to(dev, torch.int32)
    wts = torch.rand(b, k, generator=g).to(dev)
    wg, wu = _rand(dev, E, I, D, scale=D ** -0.5, dtype=_wdt(real), seed=1), \
        _rand(dev, E, I, D, scale=D ** -0.5, dtype=_wdt(real), seed=2)
    wd = _rand(dev, E, D, I, scale=I ** -0.5, dtype=_wdt(real), seed=3)
    return lambda: moe.moe_experts(h, ids, wts, wg, wu, wd)


def _moe_add_rms_norm(dev, real):   # Qwen3-Next's experts (shared one as the last rank) and the norm after them
    b, E, k, D, I = (B, 512, 10, 2048, 512) if real else (6, 10, 3, 48, 40)
    g = torch.Generator().manual_seed(0)
    h, r, nw = _rand(dev, b, D), _rand(dev, b, D, seed=4), 1 + _rand(dev, D, scale=0.1, seed=5)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(b)]).to(dev, torch.int32)
    wts, gate = torch.rand(b, k, generator=g).to(dev), _rand(dev, b, seed=6)
    wg, wu = _rand(dev, E, I, D, scale=D ** -0.5, dtype=_wdt(real), seed=1), \
        _rand(dev, E, I, D, scale=D ** -0.5, dtype=_wdt(real), seed=2)
    wd = _rand(dev, E, D, I, scale=I ** -0.5, dtype=_wdt(real), seed=3)
    return lambda: moe_norm.moe_add_rms_norm(h, ids, wts, wg, wu, wd, r, nw, 1e-6, shared_expert=E - 1,
                                             shared_gate=gate)


def _moe_experts_fp8(dev, real):
    """The moe_experts case with FP8 experts (128x128 blocks; bf16 activations at the real size)."""
    b, E, k, D, I = (B, 512, 10, 2048, 512) if real else (6, 10, 3, 48, 40)
    g = torch.Generator().manual_seed(0)
    h = _rand(dev, b, D)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b)]).to(dev, torch.int32)
    wts = torch.rand(b, k, generator=g).to(dev)
    wg, wu = quantize(_rand(dev, E, I, D, scale=D ** -0.5, seed=1)), quantize(_rand(dev, E, I, D, scale=D ** -0.5, seed=2))
    wd = quantize(_rand(dev, E, D, I, scale=I ** -0.5, seed=3))
    adt = torch.bfloat16 if real else torch.float32
    return lambda: moe.moe_experts(h, ids, wts, wg, wu, wd, act_dtype=adt)


def _router_softmax_topk(dev, real):
    E, k = (512, 10) if real else (10, 3)
    x = _rand(dev, B if real else 7, E, scale=2)
    return lambda: router.router_softmax_topk(x, k, True)


def _router_sigmoid_grouped(dev, real):   # DeepSeek-V3: 256 experts in 8 groups, 4 groups kept, top 8
    E, k, ng, tg = (256, 8, 8, 4) if real else (10, 3, 2, 1)
    x, bias = _rand(dev, B if real else 7, E, scale=2), _rand(dev, E, scale=0.3, seed=1)
    return lambda: router.router_sigmoid_grouped(x, bias, k, ng, tg, True, 2.5)


def _linear_router(dev, real):   # Qwen3-Next's router (512 experts + the shared-expert gate row, split K) and top 10
    b, K, E, k = (B, 2048, 512, 10) if real else (5, 200, 10, 3)
    x, w = _rand(dev, b, K), _rand(dev, E + 1, K, scale=K ** -0.5)
    return lambda: linear_router.linear_router(x, w, E, "softmax", k, True)


def _logits(dev, real):
    b, V = (B, 151936) if real else (9, 1000)
    return b, _rand(dev, b, V, scale=3)


def _argmax(dev, real):
    _, x = _logits(dev, real)
    return lambda: sampling.argmax(x)


def _sample(dev, real):
    b, x = _logits(dev, real)
    seeds = torch.full((b,), 1234, dtype=torch.int64, device=dev)
    streams = torch.arange(b, dtype=torch.int64, device=dev)
    pos = torch.arange(b, dtype=torch.int64, device=dev) + 100
    temp = torch.full((b,), 0.8, device=dev)
    tk = torch.full((b,), 40, dtype=torch.int32, device=dev)
    tp = torch.full((b,), 0.95, device=dev)
    return lambda: sampling.sample(x, seeds, streams, pos, temp, tk, tp)


CASES: Dict[str, Callable[[torch.device, bool], Callable[[], object]]] = {
    "linear": _linear, "linear_heads": _linear_heads, "linear_fp8": _linear_fp8, "linear_heads_fp8": _linear_heads_fp8,
    "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "gated_rms_norm": _gated_rms_norm,
    "linear_add_rms_norm": _linear_add_rms_norm,
    "silu_mul": _binary(activation.silu_mul), "sigmoid_mul": _binary(activation.sigmoid_mul),
    "add": _binary(activation.add),
    "embedding": _embedding, "rope": _rope,
    "decode_attention": _decode_attention, "write_kv": _write_kv, "norm_rope_write_kv": _norm_rope_write_kv,
    "conv1d_update": _conv1d_update, "linear_conv1d_update": _linear_conv1d_update, "conv1d_prefill": _conv1d_prefill,
    "conv1d_prefill_segments": _conv1d_prefill_segments,
    "gdn_decode": _gdn_decode, "gdn_prefill": _gdn_prefill, "gdn_prefill_segments": _gdn_prefill_segments,
    "mla_decode": _mla_decode, "write_latent": _write_latent, "norm_rope_write_latent": _norm_rope_write_latent,
    "moe_experts": _moe_experts, "moe_experts_fp8": _moe_experts_fp8, "moe_add_rms_norm": _moe_add_rms_norm,
    "router_softmax_topk": _router_softmax_topk, "router_sigmoid_grouped": _router_sigmoid_grouped,
    "linear_router": _linear_router,
    "argmax": _argmax, "sample": _sample,
}
