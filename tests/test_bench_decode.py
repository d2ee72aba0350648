"""bench/bench_decode.py end to end on the CPU (tiny preset, interpreter): the script runs, and the ds4t
model is gone before the HF peer loads -- on the H200 a session left bound to a loop variable kept a
4-layer preset's weights (25-73 GiB) alive, and DeepSeek-V3-4l's HF twin then ran out of memory."""
import gc
import sys
import weakref

import ds4t
from ds4t.testing.markers import cpu_interpreter_only
from tests.bench_scripts import load

pytestmark = cpu_interpreter_only


def test_smoke_and_the_model_is_released_before_the_hf_peer(tmp_path, monkeypatch):
    bd = load("bench/bench_decode.py", "bench_decode_smoke")
    models, alive = [], []
    real_load = ds4t.load

    def load_model(*args, **kwargs):
        m = real_load(*args, **kwargs)
        models.append(weakref.ref(m))
        return m

    def hf_part(*args, **kwargs):
        gc.collect()
        alive.append(models[-1]() is not None)
        return {}

    monkeypatch.setattr(bd.ds4t, "load", load_model)
    monkeypatch.setattr(bd, "_hf_part", hf_part)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--device", "cpu", "--models", "tiny-glm", "--ns", "1,2",
                                      "--ctx", "16", "--iters", "1", "--exact-rounds", "0", "--no-twin",
                                      "--out", str(tmp_path)])
    bd.main()
    assert alive == [False], "the ds4t model was still referenced when the HF peer would load"
    assert "| tiny-glm | 16 | 2 |" in (tmp_path / "decode.md").read_text()


def test_a_deadline_no_model_fits_is_refused(monkeypatch, capsys):
    """--deadline at or under the reserve a model keeps would skip every model and print an empty table."""
    import pytest

    bd = load("bench/bench_decode.py", "bench_decode_deadline")
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--device", "cpu", "--models", "tiny-glm", "--deadline", "140"])
    with pytest.raises(SystemExit) as e:
        bd.main()
    assert e.value.code == 2 and "--deadline 140: must exceed" in capsys.readouterr().err


def test_kernel_increments_per_name_and_in_launch_order():
    """Two steps of three kernels: an increment runs from the latest end before a kernel to its own end (0
    for a kernel that ends inside its predecessor, as under PDL a waiting kernel does); names summed per step,
    the launch order kept with medians; a trace with fewer kernels than steps gives nothing."""
    bd = load("bench/bench_decode.py", "bench_decode_increments")
    step = [("a", 0.0, 10.0), ("b", 5.0, 3.0), ("a", 12.0, 4.0)]   # b ends at 8, inside a's 10
    events = [dict(name=n, ts=t + off, dur=d + extra) for off, extra in ((100.0, 0.0), (0.0, 2.0))
              for n, t, d in step]
    rows, span, seq = bd.kernel_increments(events, 2)
    # step at 0 (durations +2): a 0-12, b 5-10 (0), a 12-18 -> increments 12, 0, 6, span 18
    # step at 100: a 100-110, b (0), a 112-116 -> increments 10, 0, 6, span 16
    assert [r[0] for r in rows] == ["a", "b"]
    assert rows[0][1:] == ((12 + 6 + 10 + 6) / 2, 2, (12 + 6 + 10 + 4) / 2) and rows[1][1] == 0.0
    assert span == 17.0
    assert seq == [("a", 11.0, 11.0), ("b", 0.0, 4.0), ("a", 6.0, 5.0)]
    assert bd.kernel_increments(events[:1], 2) == ([], 0.0, [])
