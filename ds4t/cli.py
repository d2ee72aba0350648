"""The ``ds4t`` command (also ``python -m ds4t``)."""
from __future__ import annotations

import argparse
import sys


def _table(headers, rows) -> str:
    cols = [list(map(str, c)) for c in zip(headers, *rows)]
    widths = [max(len(x) for x in c) for c in cols]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def cmd_check(args) -> int:
    """Run every kernel against its reference on this device and print a table."""
    import ds4t  # noqa: F401
    from ds4t.backend import default_device, device_name
    from ds4t.kernels.registry import all_checks

    device = default_device()
    print(f"ds4t check on {device_name()}")
    rows, failed = [], 0
    for check in all_checks():
        try:
            results = check(device)
        except Exception as e:  # a broken kernel is a row in the table, not a crash
            rows.append([getattr(check, "__module__", "?"), "-", "error", "-", "-", "-", repr(e)[:60]])
            failed += 1
            continue
        for r in results:
            rows.append([r.kernel, r.shapes, f"{r.max_err:.2e}", f"{r.tol:.0e}",
                         "yes" if r.batch_invariant else "NO", f"{r.ms:.3f}", "ok" if r.ok else "FAIL"])
            failed += not r.ok
    print(_table(["kernel", "shapes", "max err", "tol", "batch-invariant", "ms", "status"], rows))
    print(f"{len(rows) - failed}/{len(rows)} ok")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ds4t", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="run every kernel against its reference on this device")
    args = p.parse_args(argv)
    return {"check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
