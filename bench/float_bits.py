"""Float-weight outputs of linear / linear_heads / moe_experts at the GPU-table shapes, saved for a
bitwise comparison between two commits (the FP8 change must leave the float path's bits alone):

    git worktree add /tmp/pre 66a7e91                     # the commit before the FP8 kernels
    (cd /tmp/pre && python /path/to/bench/float_bits.py /tmp/old.pt)
    python bench/float_bits.py /tmp/new.pt --compare /tmp/old.pt

GPU only (the shapes are real). Prints the keys whose outputs differ (none expected)."""
import os
import sys

sys.path.insert(0, os.getcwd())   # the ds4t of the tree it runs in
import torch  # noqa: E402

import ds4t  # noqa: E402,F401
from ds4t.kernels.linear import linear, linear_heads  # noqa: E402
from ds4t.kernels.moe import moe_experts  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)
res = {}
for K, N in [(4096, 14336), (14336, 4096), (2048, 12288), (200, 333)]:
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    x = torch.randn(64, K, device="cuda", generator=g)
    for B in (1, 16, 64):
        res[f"lin{K}x{N}B{B}"] = linear(x[:B], w)
    w32 = w.float()
    res[f"lin32_{K}x{N}"] = linear(x[:5], w32)
xh = torch.randn(16, 128, 128, device="cuda", generator=g)
wh = (torch.randn(128, 512, 128, device="cuda", generator=g) * 0.1).bfloat16()
res["heads"] = linear_heads(xh, wh)
E, k, D, I = 64, 8, 2048, 512
wg = (torch.randn(E + 1, I, D, device="cuda", generator=g) * 0.02).bfloat16()
wu = (torch.randn(E + 1, I, D, device="cuda", generator=g) * 0.02).bfloat16()
wd = (torch.randn(E + 1, D, I, device="cuda", generator=g) * 0.02).bfloat16()
h = torch.randn(16, D, device="cuda", generator=g)
ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(16)]).int()
wt = torch.rand(16, k, device="cuda", generator=g)
res["moe"] = moe_experts(h, ids, wt, wg, wu, wd, shared_expert=E)
torch.save({k_: v.cpu() for k_, v in res.items()}, sys.argv[1])
print("saved", len(res), "outputs to", sys.argv[1])
if "--compare" in sys.argv:
    old = torch.load(sys.argv[sys.argv.index("--compare") + 1])
    bad = [k_ for k_ in res if not torch.equal(res[k_].cpu(), old[k_])]
    print("float-weight outputs that differ:", bad or "none")
    sys.exit(1 if bad else 0)
