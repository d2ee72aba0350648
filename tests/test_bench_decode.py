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
