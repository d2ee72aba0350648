"""The ds4t command: check, demo, support (exactness is covered in tests/exactness)."""
import subprocess
import sys

from ds4t.cli import main


def test_check_passes_every_kernel(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "error" not in out
    for kernel in ("linear", "rms_norm", "attention", "rope", "gdn", "conv", "moe", "router", "sampl", "mla", "embedding"):
        assert kernel in out, f"{kernel} missing from ds4t check"


def test_demo_small_is_bit_exact(capsys):
    assert main(["demo", "--sessions", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact: yes" in out and "speed-up" in out


def test_support_lists_every_family_and_path(capsys):
    assert main(["support"]) == 0
    out = capsys.readouterr().out
    for needle in ("qwen3_next", "deepseek_v3", "glm4_moe", "native_path='full'", "native_path='ds4'", "2051"):
        assert needle in out


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "ds4t", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "exactness" in r.stdout


def test_exactness_with_load_options_mixes_paths(capsys):
    """--opt passes load options: a tiny GLM window makes some rows fall back, still bit-exact."""
    args = ["exactness", "--model", "tiny-glm", "--opt", "native_window=12", "--mode", "auto", "--sessions", "3",
            "--steps", "3", "--max-prompt", "20", "--no-negative-control"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "exact: yes" in out and "ordered=" in out and "native=" in out


def test_bad_load_option_is_a_clear_error():
    import pytest

    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        main(["demo", "--opt", "native_window"])
