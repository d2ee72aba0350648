"""bench/hf_peer.py, the HF transformers peer of the decode benchmark: the eager step on a cache
replicated from one prefilled row, and the static-cache step recorded from generate's compiled call
(traced with the eager backend here: generate compiles only on accelerators), on a tiny preset."""
import time

import pytest

from ds4t.testing.markers import cpu_interpreter_only
from tests.bench_scripts import load

pytestmark = cpu_interpreter_only

pytest.importorskip("transformers")

hf_peer = load("bench/hf_peer.py", "bench_hf_peer")


def test_hf_peer_eager_and_static_steps_on_a_tiny_preset():
    from transformers import CompileConfig

    from ds4t.hf import hf_twin

    hf = hf_twin("tiny-glm", device="cpu")
    cfg = CompileConfig(backend="eager", mode=None)
    cfg._compile_all_devices = True
    lines = []
    rows = hf_peer.bench_hf(hf, [24], [1, 2], [1, 2], iters=1, warmup=1, budget=hf_peer.StaticBudget(600),
                            log=lines.append, compile_config=cfg)
    hf_peer.reset_compiled(hf)
    assert [(r.ctx, r.n) for r in rows] == [(24, 1), (24, 2)]
    for r in rows:
        assert r.eager_ms > 0 and r.static_ms > 0, (r, lines)
        assert "StaticCache(88 positions)" in r.static_note and "get_compiled_call" in r.static_note
    assert rows[0].eager_row0_equal and rows[0].static_row0_equal   # N=1 against itself
    assert rows[1].eager_row0_equal is not None and rows[1].static_row0_equal is not None


def test_static_budget_skips_what_would_not_fit():
    b = hf_peer.StaticBudget(100)
    assert b.allows()
    b.spend(60)
    assert not b.allows()            # another 60 s would pass 100
    b = hf_peer.StaticBudget(100)
    b.spend(30)
    b.spend(5)                        # graphs reused: the next run is predicted cheap
    assert b.allows()
    late = hf_peer.StaticBudget(1000, deadline=time.time() + 50, reserve=40)
    late.spend(20)
    assert not late.allows()          # 20 s more would eat into the 40 s kept before the deadline
