"""Sweep the Gated DeltaNet recurrence's launch constants (ds4t.kernels.gdn.GDN_CONFIGS) at Qwen3-Next-80B's
head shapes on the GPU: Dv tile, warps and the prefill's next-token prefetch.

For each config, in one run:

* prefill: one session of ``--tokens`` tokens, and 8 sessions of ``--tokens // 8`` in one launch (the
  segment kernel), ms and microseconds per token per layer;
* decode: one step at R = 1, 16, 64 rows (CUDA-graph replay, median);
* bits: a 64-token prefill equals 64 decode steps of the same config (outputs and final state, bitwise)
  -- the chunk invariance every config must keep; a config that breaks it is reported, never chosen.

    python bench/gdn_tiles.py [--tokens 1024] [--out DIR]

Full table to ``$OUT/gdn_tiles.md``; the short table is printed last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.bench_kernels import time_calls  # noqa: E402
from bench.hf_peer import median_ms  # noqa: E402
from ds4t.kernels import gdn as G  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128   # Qwen3-Next-80B-A3B's linear-attention heads
CANDIDATES = [G.GDNConfig(block_h=1, block_k=DK, block_v=bv, num_warps=w, prefetch=p)
              for bv, w, p in [(32, 4, False), (32, 4, True), (32, 2, True), (32, 1, True), (16, 2, True),
                               (16, 1, True), (8, 1, True), (64, 4, True), (64, 2, True), (128, 4, True),
                               (128, 8, True)]]


def _inputs(T: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)   # noqa: E731
    return (r(T, HK, DK).bfloat16(), r(T, HK, DK).bfloat16(), r(T, HV, DV).bfloat16(), r(T, HV).bfloat16(),
            r(T, HV).bfloat16())


def _params(dev):
    return torch.linspace(-2, 1, HV, device=dev), torch.linspace(-1, 1, HV, device=dev)


def bits(cfg, dev) -> bool:
    """64 tokens prefilled == 64 decode steps (outputs and final state), bitwise, under ``cfg``."""
    T = 64
    q, k, v, a, b = _inputs(T, dev, 1)
    A_log, dt_bias = _params(dev)
    s0 = torch.randn(2, HV, DK, DV, device=dev) * 0.1
    with G.GDN_CONFIGS.forced(lambda *key: cfg):
        sp = s0.clone()
        op = G.gdn_prefill(q, k, v, a, b, A_log, dt_bias, sp, 1)
        sd = s0.clone()
        slot = torch.tensor([1], dtype=torch.int32, device=dev)
        od = torch.cat([G.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias,
                                     sd, slot) for t in range(T)])
    return torch.equal(op, od) and torch.equal(sp, sd)


def timings(cfg, tokens: int, dev) -> dict:
    A_log, dt_bias = _params(dev)
    out = {}
    with G.GDN_CONFIGS.forced(lambda *key: cfg):
        q, k, v, a, b = _inputs(tokens, dev, 2)
        state = torch.randn(9, HV, DK, DV, device=dev) * 0.1
        out["prefill_ms"] = median_ms(lambda: G.gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, 0), 7, 2, dev)
        per = tokens // 8
        seg = torch.tensor([[i * per, per, i + 1, -1] for i in range(8)], dtype=torch.int64, device=dev)
        out["seg8_ms"] = median_ms(lambda: G.gdn_prefill_segments(q, k, v, a, b, A_log, dt_bias, state, seg),
                                   7, 2, dev)
        for R in (1, 16, 64):
            q, k, v, a, b = _inputs(R, dev, 3)
            st = torch.randn(R, HV, DK, DV, device=dev) * 0.1
            slots = torch.arange(R, dtype=torch.int32, device=dev)
            out[f"decode{R}_us"] = 1e3 * time_calls([lambda: G.gdn_decode(q, k, v, a, b, A_log, dt_bias, st, slots)])[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    os.makedirs(a.out, exist_ok=True)
    lines = [f"# Gated DeltaNet tiles on {torch.cuda.get_device_name()} (commit {a.commit}; Hk {HK}, Hv {HV}, "
             f"Dk {DK}, Dv {DV}; table config {G.GDN_CONFIGS(HV, DK, DV)})", "",
             f"| Dv tile | warps | prefetch | prefill {a.tokens} ms | us/token | 8 x {a.tokens // 8} ms | "
             "decode R=1 us | R=16 us | R=64 us | prefill == decode bits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg in CANDIDATES:
        try:
            ok = bits(cfg, dev)
            t = timings(cfg, a.tokens, dev)
            line = (f"| {cfg.block_v} | {cfg.num_warps} | {cfg.prefetch} | {t['prefill_ms']:.3f} | "
                    f"{1e3 * t['prefill_ms'] / a.tokens:.2f} | {t['seg8_ms']:.3f} | {t['decode1_us']:.1f} | "
                    f"{t['decode16_us']:.1f} | {t['decode64_us']:.1f} | {ok} |")
        except Exception as e:   # a config the compiler rejects (registers) is a row, not the end of the run
            line = f"| {cfg.block_v} | {cfg.num_warps} | {cfg.prefetch} | failed: {type(e).__name__}: {str(e)[:80]} |"
        print(line, flush=True)
        lines.append(line)
    with open(os.path.join(a.out, "gdn_tiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
