"""Bytes floor of a decode step for a preset, without weights (the model is built on 'meta').

Usage: python bench/floor.py --model qwen3-next-80b-4l --ns 1,2,4,8,16,32 --ctx 256 --bw 4.20e12
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402
from bench_decode import step_floor_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ns", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--bw", type=float, default=4.2e12, help="measured copy bandwidth, bytes/s")
    args = ap.parse_args()
    model = ds4t.load(args.model, device="meta")
    print(f"{args.model}: weights {model.weight_bytes() / 1e9:.2f} GB")
    print("| N | dense MB | routed experts MB | state MB | total MB | floor ms |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.ns.split(",")):
        f = step_floor_bytes(model, n, args.ctx)
        print(f"| {n} | {f['dense'] / 1e6:.0f} | {f['routed'] / 1e6:.0f} | {f['state'] / 1e6:.1f} | "
              f"{f['total'] / 1e6:.0f} | {f['total'] / args.bw * 1e3:.3f} |")


if __name__ == "__main__":
    main()
