"""How a bench script reports: each line printed as it comes (flushed, so a device run's output tail shows the
progress) and kept, to be written under ``--out`` with the rest of the results."""
from __future__ import annotations

import os


class Report:
    """``log = Report(); log("| a | b |"); log.write(out_dir, "name.md")``; ``log.lines`` holds the lines."""

    def __init__(self):
        self.lines = []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)

    def write(self, *path: str) -> str:
        """The lines so far into the file ``os.path.join(*path)``; returns its path."""
        p = os.path.join(*path)
        with open(p, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        return p


def bandwidth_table(log, rows) -> None:
    """The kernel-table lines of bench_fp8 / bench_gguf: one row per dict of ``rows`` (kernel, fmt, shape, B, mb
    (MB a call reads), ms, gbs, pct (% of copy bandwidth))."""
    log("| kernel | weights | shape | B | MB read | ms | GB/s | % of copy BW |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['kernel']} | {r['fmt']} | {r['shape']} | {r['B']} | {r['mb']:.0f} | {r['ms']:.4f} | "
            f"{r['gbs']:.0f} | {r['pct']:.0f}% |")


def checked_run(tool: str, args, kernels, models) -> int:
    """The driver of a bench script with a GPU-only ``kernels`` mode and a ``models`` mode (``args.what``), each
    ``mode(args, log) -> ok`` (every variant kept the base's bits): the device line, the mode's lines, PASS / FAIL
    (bits), all of them written under ``args.out`` (if set) as ``{tool}_{args.what}.md``. Returns the exit
    status, 0 / 1."""
    import torch

    log = Report()
    if args.device == "cuda":
        log(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    elif args.what == "kernels":
        raise SystemExit(f"{tool} kernels: needs a GPU (the interpreter ignores GPU tables)")
    ok = (kernels if args.what == "kernels" else models)(args, log)
    log("PASS" if ok else "FAIL (bits)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log.write(args.out, f"{tool}_{args.what}.md")
    return 0 if ok else 1
