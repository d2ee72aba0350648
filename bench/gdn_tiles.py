"""Sweep the Gated DeltaNet recurrence's launch constants (ds4t.kernels.gdn.GDN_CONFIGS) at Qwen3-Next-80B's
head shapes on the GPU: Dv tile, warps, the prefill's next-token prefetch, and the state pool's memory layout
(``dv``: Dv contiguous, ``dk``: Dk contiguous).

For each (layout, config), in one run:

* prefill: one session of ``--tokens`` tokens, and 8 sessions of ``--tokens // 8`` in one launch (the
  segment kernel), ms and microseconds per token per layer;
* decode: one step at R = 1, 16, 64 rows (CUDA-graph replay, median);
* bits: a 64-token prefill equals 64 decode steps of the same config (outputs and final state, bitwise)
  -- the chunk invariance every config must keep; and whether this config's prefill and decode give the
  bits of the layout's first config (``== first``: the condition for decode and prefill to use different
  tiles).

    python bench/gdn_tiles.py [--tokens 1024] [--layouts dv,dk] [--configs 32:4:1,8:1:1] [--inputs model] [--out DIR]

``--configs``: Dv tile : warps : prefetch (0 / 1), comma-separated. ``--inputs model``:
the prefill reads q, k, v as views of one fp32 row of conv outputs per token and a, b from a bf16 projection
row, both rewritten by a copy before each call (as the conv and the projection write them in a model step; the
copy's own median is subtracted) -- loads that may miss L2, where ``packed`` (default) reads small contiguous
tensors that stay in it. Full table to ``$OUT/gdn_tiles.md``; the
short table is printed last.
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
DEFAULT_CONFIGS = "32:4:0,32:4:1,32:2:1,32:1:1,16:2:1,16:1:1,8:1:1,8:2:1,64:4:1,64:2:1,128:4:1"


def parse_configs(text: str):
    out = []
    for item in text.split(","):
        bv, w, p = (int(x) for x in item.split(":"))
        out.append(G.GDNConfig(block_h=1, block_k=DK, block_v=bv, num_warps=w, prefetch=bool(p)))
    return out


def _inputs(T: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)   # noqa: E731
    return (r(T, HK, DK).bfloat16(), r(T, HK, DK).bfloat16(), r(T, HV, DV).bfloat16(), r(T, HV).bfloat16(),
            r(T, HV).bfloat16())


def _model_inputs(T: int, dev, seed: int):
    """(q, k, v, a, b, refresh): q, k, v fp32 views of one [T, 2 Hk Dk + Hv Dv] conv-output buffer, a, b bf16
    views of a [T, 2 Hv + 4096] projection-like buffer (the z columns between); refresh() rewrites both."""
    conv = torch.empty(T, 2 * HK * DK + HV * DV, device=dev)
    proj = torch.empty(T, 2 * HV + 4096, device=dev, dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(seed)
    conv_src = torch.randn(conv.shape, device=dev, generator=g)
    proj_src = torch.randn(proj.shape, device=dev, generator=g).bfloat16()

    def refresh():
        conv.copy_(conv_src)
        proj.copy_(proj_src)
    refresh()
    q = conv[:, :HK * DK].unflatten(1, (HK, DK))
    k = conv[:, HK * DK:2 * HK * DK].unflatten(1, (HK, DK))
    v = conv[:, 2 * HK * DK:].unflatten(1, (HV, DV))
    return q, k, v, proj[:, 4096:4096 + HV], proj[:, 4096 + HV:], refresh


def _params(dev):
    return torch.linspace(-2, 1, HV, device=dev), torch.linspace(-1, 1, HV, device=dev)


def _state(n: int, dev, layout: str, seed: int = 0) -> torch.Tensor:
    """[n, HV, DK, DV] fp32 (x 0.1), stored with Dv (``dv``) or Dk (``dk``) contiguous."""
    g = torch.Generator(device=dev).manual_seed(seed)
    s = torch.randn(n, HV, DK, DV, device=dev, generator=g) * 0.1
    return s.transpose(-1, -2).contiguous().transpose(-1, -2) if layout == "dk" else s


def runs(cfg, dev, layout: str):
    """(prefill outputs, state) of 64 tokens and (decode outputs, state) of the same 64 tokens, under ``cfg``."""
    T = 64
    q, k, v, a, b = _inputs(T, dev, 1)
    A_log, dt_bias = _params(dev)
    s0 = _state(2, dev, layout)
    with G.GDN_CONFIGS.forced(lambda *key: cfg):
        sp = s0.clone()
        op = G.gdn_prefill(q, k, v, a, b, A_log, dt_bias, sp, 1)
        sd = s0.clone()
        slot = torch.tensor([1], dtype=torch.int32, device=dev)
        od = torch.cat([G.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias,
                                     sd, slot) for t in range(T)])
    return (op, sp), (od, sd)


def _same(x, y) -> bool:
    return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def timings(cfg, tokens: int, dev, layout: str, inputs: str = "packed") -> dict:
    A_log, dt_bias = _params(dev)
    out = {}
    with G.GDN_CONFIGS.forced(lambda *key: cfg):
        if inputs == "model":
            q, k, v, a, b, refresh = _model_inputs(tokens, dev, 2)
            base = median_ms(refresh, 7, 2, dev)
        else:
            (q, k, v, a, b), refresh, base = _inputs(tokens, dev, 2), (lambda: None), 0.0
        state = _state(9, dev, layout)

        def timed(fn):
            return median_ms(lambda: (refresh(), fn()), 7, 2, dev) - base
        out["prefill_ms"] = timed(lambda: G.gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, 0))
        per = tokens // 8
        seg = torch.tensor([[i * per, per, i + 1, -1] for i in range(8)], dtype=torch.int64, device=dev)
        out["seg8_ms"] = timed(lambda: G.gdn_prefill_segments(q, k, v, a, b, A_log, dt_bias, state, seg))
        for R in (1, 16, 64):
            q, k, v, a, b = _inputs(R, dev, 3)
            st = _state(R, dev, layout, seed=R)
            slots = torch.arange(R, dtype=torch.int32, device=dev)
            out[f"decode{R}_us"] = 1e3 * time_calls([lambda: G.gdn_decode(q, k, v, a, b, A_log, dt_bias, st, slots)])[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layouts", default="dv,dk")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--inputs", default="packed", choices=("packed", "model"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    os.makedirs(a.out, exist_ok=True)
    lines = [f"# Gated DeltaNet tiles on {torch.cuda.get_device_name()} (commit {a.commit}; Hk {HK}, Hv {HV}, "
             f"Dk {DK}, Dv {DV}; {a.inputs} inputs; table configs: dk {G.GDN_CONFIGS(HV, DK, DV, 'dk')}, "
             f"dv {G.GDN_CONFIGS(HV, DK, DV, 'dv')})", "",
             f"| layout | Dv tile | warps | prefetch | prefill {a.tokens} ms | us/token | 8 x {a.tokens // 8} ms | "
             "decode R=1 us | R=16 us | R=64 us | prefill == decode | prefill == first | decode == first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout in a.layouts.split(","):
        first = None
        for cfg in parse_configs(a.configs):
            head = f"| {layout} | {cfg.block_v} | {cfg.num_warps} | {cfg.prefetch} |"
            try:
                pre, dec = runs(cfg, dev, layout)
                first = first or dec
                t = timings(cfg, a.tokens, dev, layout, a.inputs)
                line = (f"{head} {t['prefill_ms']:.3f} | {1e3 * t['prefill_ms'] / a.tokens:.2f} | {t['seg8_ms']:.3f} | "
                        f"{t['decode1_us']:.1f} | {t['decode16_us']:.1f} | {t['decode64_us']:.1f} | "
                        f"{_same(pre, dec)} | {_same(pre, first)} | {_same(dec, first)} |")
            except Exception as e:   # a config the compiler rejects (registers) is a row, not the end of the run
                line = f"{head} failed: {type(e).__name__}: {str(e)[:80]} |"
            print(line, flush=True)
            lines.append(line)
    with open(os.path.join(a.out, "gdn_tiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
