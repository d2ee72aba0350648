"""bench/one_row_programs.py: its candidates change the tables as named, and a CPU smoke run."""
from tests.bench_scripts import load

orp = load("bench/one_row_programs.py", "bench_one_row_programs")
A, M = orp.A, orp.M


def test_candidates_set_the_fields_they_name_on_the_gpu_table():
    """Under ``attention_parts`` every decode-attention key has the parts for one row; under ``ordered_split`` an
    FP8 gate/up few-rows key (GLM-4.5's K = 5120 entry and a K without one) has the ordered split and keeps its own
    fields, while the decode entries stay the table's. Control: outside them the table has neither."""
    key = (64, 256, 256)
    with orp.attention_parts(4, gpu=True):
        cfg = A.ATTENTION_CONFIGS(*key)
    assert (cfg.dv_parts, cfg.dv_rows) == (4, 1)
    glm_few = M.MOE_CONFIGS.gpu[("gate_up", "fp8", "few", 5120)]
    with orp.ordered_split(4, gpu=True):
        few = M.MOE_CONFIGS("gate_up", "fp8", "few", 5120)
        other = M.MOE_CONFIGS("gate_up", "fp8", "few", 2048)
        decode = M.MOE_CONFIGS("gate_up", "fp8")
    assert (few.split, few.ordered_split, few.max_rows, few.scale_blocks) == (4, True, 2, glm_few.scale_blocks)
    assert (other.split, other.ordered_split, other.max_rows) == (4, True, 2)
    assert decode == M.MOE_CONFIGS.gpu[("gate_up", "fp8")]
    assert M.few_entry_keeps_bits(other, decode, "gate_up", True)
    assert M.MOE_CONFIGS.gpu[("gate_up", "fp8")].split == 1 and not glm_few.ordered_split


def test_models_smoke_on_a_tiny_preset(tmp_path, device):
    """Every candidate on a tiny FP8 preset: the same bits as the table, native == ordered."""
    assert orp.main(["models", "--device", str(device), "--models", "tiny-qwen:fp8", "--ns", "1,2",
                     "--out", str(tmp_path)]) == 0
    text = (tmp_path / "one_row_programs_models.md").read_text()
    for name in ("attn-parts-2", "attn-parts-4", "moe-ordered-2", "moe-ordered-8"):
        assert f"N=2 {name}:" in text and "bits same" in text
    assert text.rstrip().endswith("PASS")


def test_mla_candidates_set_the_few_row_fields_on_the_gpu_table():
    """``mla_few_rows``: every MLA key of the GPU table with the named few-row rows (and stages), the rest of the
    entry kept; a launch of more rows takes the entry's own stages. Control: outside it the table's own entry."""
    key = (128, 512, 64, 128)
    table = orp.MLA.MLA_CONFIGS.gpu.get(key) or orp.MLA.MLA_CONFIGS.gpu_rule(*key)
    with orp.mla_few_rows(4, 5, 16):
        cfg = orp.MLA.MLA_CONFIGS(*key)
    assert (cfg.few_rows, cfg.few_stages, cfg.few_heads, cfg.block_h) == (4, 5, 16, table.block_h)
    assert cfg.split_tile(4) == (16, 5) and cfg.split_tile(5) == (table.block_h, table.num_stages)
    with orp.mla_few_rows(0):
        assert orp.MLA.MLA_CONFIGS(*key).split_tile(1) == (table.block_h, table.num_stages)
    assert orp.MLA.MLA_CONFIGS.gpu_rule(*key) == table
