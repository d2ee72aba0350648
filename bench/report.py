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
