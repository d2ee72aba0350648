"""Which heads / experts / rows a rank holds (no process group needed), and the errors for a tp that
cannot shard a model."""
import pytest

import ds4t
from ds4t.parallel import ParallelError, split
from ds4t.parallel.shard import Part, check_config, local_config


def test_even_ranges_cover_the_axis():
    assert [split.even(12, r, 3, "x") for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ParallelError, match=r"tp=5 does not divide num_attention_heads \(12\)"):
        split.even(12, 0, 5, "num_attention_heads")


@pytest.mark.parametrize("H,KV,size,want", [
    (16, 8, 2, [(0, 4), (4, 8)]),                     # kv heads split
    (16, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),     # tp > kv heads: each kv head on 2 ranks
    (4, 1, 2, [(0, 1), (0, 1)]),                      # MQA
])
def test_kv_heads_follow_the_query_heads(H, KV, size, want):
    assert [split.kv_heads(H, KV, r, size) for r in range(size)] == want


def test_block_ranges_cover_the_axis_in_whole_blocks():
    # GLM-4.5's 1536-wide shared expert in 128-column FP8 blocks over 8 ranks: 2, 2, 2, 2, 1, 1, 1, 1 blocks
    r = [split.blocks(1536, 128, k, 8, "x") for k in range(8)]
    assert r == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1152), (1152, 1280), (1280, 1408),
                 (1408, 1536)]
    assert [split.blocks(300, 128, k, 2, "x") for k in range(2)] == [(0, 256), (256, 300)]   # a partial last block
    with pytest.raises(ParallelError, match=r"tp=4: the MLP \(300 columns\) is 3 block\(s\) of 128 columns, fewer"):
        split.blocks(300, 128, 0, 4, "the MLP")


def test_kv_heads_that_cannot_be_placed():
    with pytest.raises(ParallelError, match="num_key_value_heads"):
        split.kv_heads(24, 6, 0, 4)


def test_vocab_shards_are_padded_to_one_size():
    assert [split.vocab(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


def test_config_checks_name_the_field():
    from ds4t.models.qwen import QwenConfig, preset_config

    c = QwenConfig.from_dict(preset_config("tiny-qwen"))   # 4 heads, 2 kv, 2 GDN key heads, 8 experts
    check_config(c, Part(0, 2))
    with pytest.raises(ParallelError, match="num_attention_heads"):
        check_config(c, Part(0, 3))
    with pytest.raises(ParallelError, match="linear_num_key_heads"):
        check_config(c, Part(0, 4))
    loc = local_config(c, Part(1, 2))
    assert (loc.num_heads, loc.num_kv_heads, loc.lin_k_heads, loc.lin_v_heads) == (2, 1, 1, 2)
    assert loc.hidden_size == c.hidden_size and loc.num_experts == c.num_experts


def test_load_with_tp_needs_a_process_group():
    with pytest.raises(ParallelError, match="initialised torch.distributed process group"):
        ds4t.load("tiny-qwen", tp=2)
    with pytest.raises(ParallelError, match="positive int"):
        ds4t.load("tiny-qwen", tp=0)
