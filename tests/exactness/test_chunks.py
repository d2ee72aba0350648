"""The harness's prefill chunk-invariance check (ds4t.exactness.chunks): holds for every family,
and its negative control (a linear whose K sum order depends on the launch's row count) is caught."""
import pytest

import ds4t
from ds4t.backend import INTERPRET
from ds4t.cli import main
from ds4t.exactness.chunks import run_chunk_check
from ds4t.exactness.harness import plant
from ds4t.testing.markers import cpu_interpreter_only

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


def _row_tiles(monkeypatch, k_tile_changes: bool = False):
    """Row tiles forced on in the interpreter from 8 rows (linear: 32 x 64; MoE grouped kernels: 32-pair
    tiles): the whole-prompt prefill (12 rows) runs them, chunks of 1 and 5 and the token-by-token rows
    the decode tiles. ``k_tile_changes``: let the row tile keep its own BLOCK_K (32) in the interpreter,
    whose MMA sums each K tile before adding it — a row tile that changed the K order."""
    import contextlib

    from ds4t.kernels import linear as L
    from ds4t.kernels import moe as M
    from ds4t.kernels.registry import GPU, use_variants

    if k_tile_changes:
        monkeypatch.setattr(L, "INTERPRET", False)
    tile = L.RowTile(min_rows=8, block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2)
    base = M.MOE_CONFIGS.interp_rule("gate_up")
    rows = M.MoEConfig(tile_n=64, tile_k=base.tile_k, block_m=32, min_rows=8)
    stack = contextlib.ExitStack()
    stack.enter_context(L.LINEAR_ROW_TILES.forced(lambda *key: (tile,)))
    stack.enter_context(M.MOE_CONFIGS.forced(lambda kernel, *f: rows if f[-1:] == ("rows",) else base))
    stack.enter_context(use_variants({"moe_experts": GPU}))
    return stack


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_row_tiles_keep_chunk_invariance(monkeypatch, preset):
    """With row tiles on (what a prefill chunk of >= 128 rows runs on the GPU), the whole prompt, its
    chunks and token-by-token decoding still give the same logits and state, bit for bit."""
    with _row_tiles(monkeypatch):
        rep = run_chunk_check(ds4t.load(preset), PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch


@cpu_interpreter_only
def test_row_tiles_control_a_changed_k_order_is_caught(monkeypatch):
    """The interpreter keeps the decode K tile for row tiles; this control lets a row tile's K tile differ (what
    the GPU would do without the rule) and the check must catch it. On the GPU the rule is pinned by
    test_table_row_tiles_keep_every_rows_bits, with the table's real tiles."""
    with _row_tiles(monkeypatch, k_tile_changes=True):
        rep = run_chunk_check(ds4t.load("tiny-qwen"), PROMPT, chunks=(1,), in_batch=False)
    assert not rep.ok and "logits differ from the whole prompt" in rep.first_mismatch


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-glm"])
def test_fp8_moe_table_tiles_keep_chunk_invariance(preset):
    """The GPU's FP8 MoE entries (swapped tiles: the weight rows on the MMA's M side) forced in the
    interpreter on an FP8 model: whole prompt, chunks and token-by-token decoding give the same bits."""
    from ds4t.kernels import moe as M
    from ds4t.kernels.registry import GPU, use_variants

    table = dict(M.MOE_CONFIGS.gpu)
    assert table[("gate_up", "fp8")].swap and table[("down", "fp8")].swap
    with M.MOE_CONFIGS.forced(M.MOE_CONFIGS.gpu_entries()), use_variants({"moe_experts": GPU}):
        rep = run_chunk_check(ds4t.load(preset, quantize="fp8"), PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-glm"])
def test_chunks_on_the_gpu_attention_launches(preset, monkeypatch):
    """With the GPU's attention launches (variant "gpu", in the interpreter too): a chunk's rows take the
    same-slot runs kernel (K / V tiles shared by 4 rows), token-by-token rows the split kernel, and the
    chunk check still holds bitwise."""
    from ds4t.kernels import attention as A
    from ds4t.kernels.registry import GPU, use_variants

    launches = []
    real = A._attn_runs_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(A, "_attn_runs_kernel", Spy())
    with use_variants({"decode_attention": GPU}):
        rep = run_chunk_check(ds4t.load(preset), PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch
    assert launches, "no chunk took the runs kernel"


@pytest.mark.parametrize("preset,qtype", [("tiny-qwen", "q4_k"), ("tiny-deepseek", "q8_0"), ("tiny-glm", "q5_k")])
def test_gguf_fold_route_keeps_chunk_invariance(preset, qtype):
    """GGUF blocks with bf16 activations take the fold route (one packed bf16 FMA a weight pair, one MMA a
    loop step: ds4t.kernels.qlinear): whole prompt, chunks and token-by-token decoding give the same bits."""
    from ds4t.kernels.qlinear import folds, qlinear_config
    from tests.models.test_gguf_blocks import _block_weights

    model = ds4t.load(preset, quantize=qtype, dtype="bf16")
    kept = _block_weights(model)
    assert kept and any(folds(qlinear_config(256, 64, q, model.dtype), model.dtype) for _, q in kept)
    rep = run_chunk_check(model, PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q8_0"])
def test_moe_row_programs_keep_chunk_invariance(fmt, monkeypatch):
    """MoE launches of >= 2 rows in row programs (one program per row tile, ``MoEConfig.row_programs`` /
    ``QMoEConfig.row_programs``; the GPU's grouped kernels in the interpreter, the interpreter's tiles): whole
    prompt, chunks and token-by-token decoding give the same bits, and row programs did run."""
    import dataclasses

    from ds4t.kernels import moe as M, qmoe as QM
    from ds4t.kernels.registry import GPU, use_variants

    rows = dataclasses.replace(M._INTERP_CONFIG, row_programs=True, min_rows=2)
    def moe_rule(kernel, *f):
        return rows if f[-1:] == ("rows",) else None if "few" in f else M._INTERP_CONFIG

    interp = QM.QMOE_CONFIGS.interp_rule   # (forced() puts its rule there)

    def qmoe_rule(kernel, qtype, *r):
        cfg = interp(kernel, qtype)
        return dataclasses.replace(cfg, row_programs=True, min_rows=2) if r else cfg

    calls = []
    for mod in (M, QM):   # the launchers size a row-program grid with it
        real = mod.row_program_count
        monkeypatch.setattr(mod, "row_program_count", lambda *a, real=real: calls.append(a) or real(*a))
    model = ds4t.load("tiny-qwen", **({"quantize": fmt} if fmt != "bf16" else {}), dtype="bf16")
    with M.MOE_CONFIGS.forced(moe_rule), QM.QMOE_CONFIGS.forced(qmoe_rule), use_variants({"moe_experts": GPU}):
        rep = run_chunk_check(model, PROMPT, chunks=(1, 5, len(PROMPT)))
    assert rep.ok, rep.first_mismatch
    assert calls
    if fmt == "bf16" and INTERPRET:   # negative control (the interpreter looks jit helpers up at call time):
        # a tile finder that drops half of every tile; buffers start NaN
        from tests.kernels.invariance import half_row_tiles, poison_empty

        poison_empty(monkeypatch)
        monkeypatch.setattr(M, "_program_tile", half_row_tiles)
        with M.MOE_CONFIGS.forced(moe_rule), use_variants({"moe_experts": GPU}):
            assert not run_chunk_check(model, PROMPT, chunks=(1, 5, len(PROMPT))).ok
