"""The layout fact behind "FP8 weights get no row tiles" (docs/kernel-conventions.md), checked without a GPU:
compiled for sm_90, a dot fed from fp8 loads gets kWidth 4 operands on mma.sync (a permuted K order) and
kWidth 2 on wgmma, while bf16 dots get kWidth 2 on both. If a Triton upgrade changes this, FP8 row tiles
may become possible (and the docs are wrong): this test says so."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fp8_dots_on_mma_sync_permute_k_and_bf16_dots_do_not():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "mma_shapes.py"), "--kwidth"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r.strip("|").split("|") for r in p.stdout.splitlines() if r.startswith("| ") and "kWidth" not in r]
    table = {(w.strip(), t.strip()): (g.strip() == "True", k.strip()) for w, t, g, k in rows}
    assert len(table) == 20
    for (weights, tile), (wgmma, kwidth) in table.items():
        want = "4" if weights.startswith("fp8") and not wgmma else "2"
        assert kwidth == want, (weights, tile, wgmma, kwidth)
    assert table[("bf16", "64 x 4")][0] and not table[("bf16", "16 x 4")][0]   # both instruction kinds seen
