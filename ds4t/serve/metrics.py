"""Server metrics in the Prometheus text format (``/metrics``), kept by hand: a few counters,
histograms and gauges need no client library."""
from __future__ import annotations

import collections
import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple

PREFIX = "ds4t_serve_"


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.buckets = sorted(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str, help_: str) -> List[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for b, c in zip(self.buckets, self.counts):
            out.append(f'{name}_bucket{{le="{_num(b)}"}} {c}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Metrics:
    """Thread-safe: the decode worker observes batches and tokens, HTTP handlers count requests."""

    RATE_WINDOW_S = 10.0

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.batch_items = Histogram([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256])
        self.batch_rows = Histogram([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
        self.step_seconds = Histogram([0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10])
        self.itl_seconds = Histogram([0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10])
        self.ttft_seconds = Histogram([0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60])
        self.counters: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = collections.defaultdict(float)
        self._recent: "collections.deque[Tuple[float, int]]" = collections.deque()

    def inc(self, name: str, v: float = 1, **labels) -> None:
        with self._lock:
            self.counters[(name, tuple(sorted(labels.items())))] += v

    def get(self, name: str, **labels) -> float:
        with self._lock:
            return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def observe_batch(self, items: int, rows: int, seconds: float, native_rows: int, ordered_rows: int,
                      prefill_tokens: int, decode_rows: int) -> None:
        with self._lock:
            self.batch_items.observe(items)
            self.batch_rows.observe(rows)
            self.step_seconds.observe(seconds)
            for name, v in (("batches_total", 1), ("native_items_total", native_rows),
                            ("ordered_items_total", ordered_rows), ("prefill_tokens_total", prefill_tokens),
                            ("decode_rows_total", decode_rows)):
                self.counters[(name, ())] += v

    def observe_speculation(self, drafted: int, accepted: int) -> None:
        """One slot's speculative step: drafts verified and drafts equal to the model's own choice."""
        with self._lock:
            self.counters[("spec_drafted_tokens_total", ())] += drafted
            self.counters[("spec_accepted_tokens_total", ())] += accepted

    def observe_tokens(self, n: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.counters[("generated_tokens_total", ())] += n
            self._recent.append((now, n))
            self._trim(now)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl_seconds.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_seconds.observe(seconds)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            n = sum(k for _, k in self._recent)
        span = min(self.RATE_WINDOW_S, max(1e-9, time.time() - self.started))
        return n / span

    def render(self, gauges: Dict[str, Tuple[float, str]]) -> str:
        """Prometheus text exposition; ``gauges``: name -> (value, help) sampled by the caller."""
        lines: List[str] = []
        tps = self.tokens_per_second()
        with self._lock:
            g = dict(gauges)
            g["tokens_per_second"] = (tps, f"generated tokens per second over the last {self.RATE_WINDOW_S:.0f} s")
            for name, (v, help_) in sorted(g.items()):
                lines += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {_num(v)}"]
            by_name: Dict[str, List[Tuple[Tuple[Tuple[str, str], ...], float]]] = collections.defaultdict(list)
            for (name, labels), v in self.counters.items():
                by_name[name].append((labels, v))
            for name in sorted(by_name):
                lines += [f"# HELP {PREFIX}{name} {_COUNTER_HELP.get(name, name)}", f"# TYPE {PREFIX}{name} counter"]
                for labels, v in sorted(by_name[name]):
                    lab = ",".join(f'{k}="{val}"' for k, val in labels)
                    lines.append(f"{PREFIX}{name}{{{lab}}} {_num(v)}" if lab else f"{PREFIX}{name} {_num(v)}")
            lines += self.batch_items.lines(PREFIX + "batch_items", "sessions (items) per eval_batch call")
            lines += self.batch_rows.lines(PREFIX + "batch_rows", "token rows per eval_batch call (decode rows + prefill chunk tokens)")
            lines += self.step_seconds.lines(PREFIX + "step_seconds", "wall time of one batched step (forward + sampling)")
            lines += self.itl_seconds.lines(PREFIX + "inter_token_seconds", "time between consecutive tokens of a request")
            lines += self.ttft_seconds.lines(PREFIX + "time_to_first_token_seconds", "request arrival to its first token")
        return "\n".join(lines) + "\n"


_COUNTER_HELP = {
    "batches_total": "eval_batch calls",
    "native_items_total": "batch items that ran on the native path",
    "ordered_items_total": "batch items that ran on the ordered fallback",
    "prefill_tokens_total": "prompt tokens prefilled",
    "decode_rows_total": "decode rows evaluated",
    "generated_tokens_total": "tokens generated",
    "spec_drafted_tokens_total": "speculative decoding: draft tokens verified (--mtp)",
    "spec_accepted_tokens_total": "speculative decoding: drafts equal to the model's own choice (--mtp)",
    "requests_total": "finished requests by outcome",
    "prefix_reused_tokens_total": "prompt tokens skipped thanks to a resident slot's history",
    "restored_tokens_total": "prompt tokens skipped thanks to a state restored from --kv-cache-dir",
    "evictions_total": "idle slots reset for another conversation",
    "kv_saves_total": "slot states queued for writing to --kv-cache-dir",
    "kv_restores_total": "slot states restored from --kv-cache-dir",
    "kv_corrupt_total": "saved states found corrupt (never used; the conversation was prefilled again)",
    "kv_restore_failures_total": "restores that could not be used (the prompt was prefilled in full)",
    "http_errors_total": "requests refused with an HTTP error",
}
