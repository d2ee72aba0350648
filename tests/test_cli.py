"""The ds4t command: check, demo, support, exactness's verdicts, errors, --help, --version, progress."""
import subprocess
import sys

import pytest
import torch

import ds4t
from ds4t.cli import main


def _run(argv, capsys):
    """(exit code, stdout, stderr) of ``ds4t argv`` run in-process."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


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


@pytest.mark.parametrize("call", [1, 3])   # the prompt's logits, a decode step's
def test_demo_nan_logits_are_a_one_line_error(capsys, monkeypatch, call):
    """A session whose logits hold a NaN has no greedy token (sampling's NO_TOKEN): the demo stops with one line
    naming the session, exit 1 -- torch's argmax would feed the NaN's index back as a token."""
    real, calls = ds4t.eval_batch, []

    def poisoned(*a, **k):
        res = real(*a, **k)
        calls.append(1)
        if len(calls) == call:
            res.logits[1, 5] = float("nan")
        return res

    monkeypatch.setattr(ds4t, "eval_batch", poisoned)
    rc, out, err = _run(["demo", "--sessions", "3", "--steps", "3"], capsys)
    assert rc == 1 and len(calls) == call
    assert err.strip().splitlines() == [err.strip()] and "session 1's logits hold a NaN" in err and "Traceback" not in err


def test_demo_mtp_tokens_equal_the_native_run(capsys):
    rc, out, err = _run(["demo", "--model", "tiny-deepseek", "--mtp", "2", "--sessions", "2", "--steps", "3"], capsys)
    assert rc == 0 and "speculative tokens equal to the native run: yes" in out


def test_support_lists_every_family_and_path(capsys):
    assert main(["support"]) == 0
    out = capsys.readouterr().out
    for needle in ("qwen3_next", "deepseek_v3", "glm4_moe", "native_path='full'", "native_path='ds4'", "no limit"):
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


OTHER_DEVICE = "cpu" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--opt", "native_window"], "expected KEY=VALUE"),
    (["demo", "--device", OTHER_DEVICE], f"--device {OTHER_DEVICE}"),
    (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["demo", "--sessions", "0"], "--sessions: expected a positive integer, got 0"),
    (["exactness", "--steps", "-1"], "--steps: expected a positive integer, got -1"),
    (["exactness", "--sessions", "two"], "--sessions: expected a positive integer, got 'two'"),
    (["demo", "--model", "tiny-nothing"], "'tiny-nothing' is neither a checkpoint directory, a .gguf file nor a preset"),
    (["demo", "--opt", "native_window=20"], "qwen3_next models take no option 'native_window'"),
    (["exactness", "--model", "tiny-glm", "--opt", "native_window=0"], "native_window must be a positive int"),
    (["demo", "--dtype", "fp8"], "unsupported dtype 'fp8'"),
    (["check", "--kernel", "lineaer"], "no such kernel; names: "),
    (["convert", "tiny-llama", "/nonexistent-ds4t/x.gguf"], "the folder '/nonexistent-ds4t' does not exist"),
    (["convert", "tiny-llama", "/proc/x.gguf"], "'/proc/x.gguf': cannot write"),
    (["demo", "--model", __file__], "is neither a checkpoint directory"),
    (["demo", "--model", "tiny-llama", "--mtp", "2"], "--mtp 2: 'tiny-llama' has no MTP head to draft with"),
])
def test_user_errors_are_one_line_with_exit_code_2(capsys, argv, needle):
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert out == "" and err.count("\n") == 1 and err.startswith(f"ds4t {argv[0]}: error: "), err
    assert needle in err and "Traceback" not in err


def test_unknown_kernel_error_lists_the_names(capsys):
    _, _, err = _run(["check", "--kernel", "nope"], capsys)
    for name in ("linear", "linear_heads", "rms_norm", "moe", "sample"):
        assert f" {name}," in err or err.rstrip().endswith(f" {name}")


def test_version(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"ds4t {ds4t.__version__}"


def test_help_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")   # argparse wraps help at the terminal width
    rc, out, _ = _run(["exactness", "--help"], capsys)
    assert rc == 0
    for needle in ("(default: tiny-qwen)", "(default: 6)", "(default: 40)", "(default: native)"):
        assert needle in out, needle


def test_check_one_kernel_by_op_or_module_name(capsys):
    rc, out, _ = _run(["check", "--kernel", "rms_norm"], capsys)
    assert rc == 0
    table = out.splitlines()[3:-1]
    assert table and all(line.split()[0] == "rms_norm" for line in table), out
    rc, out, _ = _run(["check", "--kernel", "embedding", "--kernel", "silu_mul"], capsys)
    kernels = {line.split()[0] for line in out.splitlines()[3:-1]}
    assert rc == 0 and kernels == {"embedding", "silu_mul"}, out


def test_progress_bar_on_request_only(capsys):
    rc, out, err = _run(["demo", "--sessions", "2", "--steps", "2"], capsys)
    assert rc == 0 and err == ""   # stderr is not a terminal here: no bar unless asked
    rc, out, err = _run(["demo", "--sessions", "2", "--steps", "2", "--progress"], capsys)
    assert rc == 0 and "ordered" in err and "native" in err and "/2" in err
    assert "bit-exact: yes" in out   # the bar goes to stderr, the results to stdout


GLM_NO_NATIVE = ["exactness", "--model", "tiny-glm", "--opt", "native_window=1", "--mode", "auto",
                 "--sessions", "3", "--steps", "3"]


def test_exactness_control_not_applicable_when_nothing_runs_natively(capsys):
    """native_window=1: every row falls back to ordered, so a batch-dependent kernel has nothing to
    show in; the control says so instead of "NOT CAUGHT", and an exact run exits 0."""
    rc, out, _ = _run(GLM_NO_NATIVE, capsys)
    assert "NOT CAUGHT" not in out and "not applicable (no native call of 2+ rows)" in out
    assert "no row ran natively" in out and "exact: yes" in out
    assert rc == 0


def test_exactness_fails_when_an_applicable_control_is_not_caught(capsys, monkeypatch):
    """Negative control of the exit code: planting nothing leaves the batch-dependent control
    applicable (rows batch natively) and not caught, which must fail the run."""
    import contextlib

    from ds4t.exactness import controls

    monkeypatch.setattr(controls, "plant", lambda kind: contextlib.nullcontext())
    rc, out, _ = _run(["exactness", "--model", "tiny-qwen", "--sessions", "2", "--steps", "2", "--max-prompt", "6"],
                      capsys)
    assert "NOT CAUGHT" in out and "exact: yes" in out
    assert rc == 1


def test_demo_of_a_gguf_prints_text(tmp_path, capsys):
    """A checkpoint with a tokenizer (here a tiny GGUF) gets chat prompts and its text printed."""
    pytest.importorskip("transformers")
    from tests.models.gguf_files import write_gguf
    from tests.models.test_gguf import tiny_llama

    write_gguf(tiny_llama(), tmp_path / "m.gguf")
    assert main(["demo", "--model", str(tmp_path / "m.gguf"), "--sessions", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "chat prompts through the checkpoint's tokenizer" in out and "bit-exact: yes" in out
    assert "'What is the capital of France?' -> " in out and "'What is 12 times 12?' -> " in out


SOAK = ["exactness", "--model", "tiny-llama", "--sessions", "3", "--steps", "3", "--max-prompt", "24",
        "--no-negative-control", "--no-progress"]


def test_exactness_soak_runs_every_kind_and_replays_a_case_by_its_seed(capsys):
    """--soak N: N seeded cases, the kind from the seed (scenario, chunks, speculative in turn); --soak 1
    --seed S replays case S alone, the same kind."""
    rc, out, _ = _run(SOAK + ["--soak", "3"], capsys)
    assert rc == 0 and "soak: 3 of 3 random cases" in out and "exact: yes" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in
            (["scenario"], ["chunks"], ["speculative"])}
    assert {k: v[0] for k, v in rows.items()} == {"scenario": "1", "chunks": "1", "speculative": "1"}
    rc, out, _ = _run(SOAK + ["--soak", "1", "--seed", "4"], capsys)
    assert rc == 0 and "chunks       1" in out and "scenario     0" in out


def test_exactness_soak_stops_at_the_first_case_that_differs(capsys):
    """Negative control: under a batch-dependent linear the first soak case (a session mix) differs; the run
    stops there, names its seed and fails."""
    from ds4t.exactness.harness import plant

    with plant("batch-dependent"):
        rc, out, _ = _run(SOAK + ["--rounds", "1", "--soak", "3", "--seed", "3"], capsys)
    assert rc == 1 and "soak: 1 of 3 random cases" in out
    assert "soak case 3 (scenario) differed" in out and "--soak 1 --seed 3" in out and "exact: NO" in out
