"""The harness's prefill chunk-invariance check (ds4t.exactness.chunks): holds for every family,
and its negative control (a linear whose K sum order depends on the launch's row count) is caught."""
import pytest

import ds4t
from ds4t.cli import main
from ds4t.exactness.chunks import run_chunk_check
from ds4t.exactness.harness import plant

PROMPT = [5, 17, 99, 3, 250, 8, 41, 7, 66, 12, 1, 2]


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_chunks_and_token_by_token_are_bitwise_equal(preset):
    rep = run_chunk_check(ds4t.load(preset), PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch
    assert rep.rows == 4 * len(PROMPT) and rep.states > 0 and rep.paths == {"native": 2 * len(PROMPT)}


def test_negative_control_is_caught():
    with plant("batch-dependent"):
        rep = run_chunk_check(ds4t.load("tiny-qwen"), PROMPT, chunks=(1, 5), in_batch=False)
    assert not rep.ok and rep.mismatches > 0
    assert "logits differ from the whole prompt" in rep.first_mismatch


def test_rows_that_fall_back_are_reported():
    """GLM with a 4-token window: token by token, the rows past it run ordered; the check says so."""
    rep = run_chunk_check(ds4t.load("tiny-glm", native_window=4), PROMPT, chunks=(3,))
    assert rep.mismatches == 0 and rep.paths.get("ordered", 0) > 0 and not rep.ok


def test_bad_arguments():
    m = ds4t.load("tiny-qwen")
    with pytest.raises(ValueError, match="empty"):
        run_chunk_check(m, [], chunks=(1,))
    with pytest.raises(ValueError, match="positive ints"):
        run_chunk_check(m, PROMPT, chunks=(0,))


def test_cli_chunks_check_and_control(capsys):
    assert main(["exactness", "--model", "tiny-qwen", "--sessions", "2", "--steps", "2", "--max-prompt", "9",
                 "--chunks", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "prefill chunk invariance (9-token prompt" in out and "caught" in out and "NOT CAUGHT" not in out


def test_cli_chunks_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        main(["exactness", "--model", "tiny-qwen", "--chunks", "0,4"])
    assert "positive chunk sizes" in capsys.readouterr().err
