"""The sharding rules, checked in one process: the shards of all ranks put back together give the
fused weights of the whole model (rows of column-parallel matrices, columns of row-parallel ones,
whole experts), for every family; FP8 weights keep their per-row scales and are cut on scale blocks."""
import pytest
import torch

import ds4t
from ds4t.kernels.weights import quantize
from ds4t.models.decoder import named_tensors
from ds4t.parallel import ParallelError
from ds4t.parallel.shard import Part, cols, layer, rows
from ds4t.testing import TINY_PRESETS


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_weight_is_held_once_or_replicated(preset):
    """Per layer: each shard tensor's elements are a subset of the whole tensor's, and the bytes all
    ranks hold equal the whole layer's plus what is replicated (checked by element count)."""
    m = ds4t.load(preset)
    for i, lw in enumerate(m.layers):
        shards = [layer(lw, m.cfg, Part(r, 2), f"layers.{i}") for r in range(2)]

        whole = dict(named_tensors(lw, "l"))
        parts = [dict(named_tensors(s, "l")) for s in shards]
        for name, t in parts[0].items():
            if name not in whole:   # the split shared expert: its width halves
                assert name.startswith("l.ffn.shared"), name
                continue
            w, t1 = whole[name], parts[1].get(name)
            if t1 is None:          # a row-parallel bias on rank 0 only
                assert torch.equal(t, w)
                continue
            same = t.shape == w.shape
            if same:                # replicated (norms, routers, MLA's down-projection)
                assert torch.equal(t, w) and torch.equal(t1, w), name
            else:
                n = w.numel()
                if name.split(".")[-1] in ("w_gate", "w_up", "w_down") and lw.ffn.shared_index is not None:
                    n -= n // w.shape[0]   # the fused shared expert leaves the stack (split beside it)
                assert t.numel() + t1.numel() == n, name


def test_gqa_shards_rebuild_q_k_v_and_o():
    m = ds4t.load("tiny-llama")   # 4 heads, 2 kv heads, head_dim 16, hidden 64
    w = m.layers[0].mixer
    s = [layer(m.layers[0], m.cfg, Part(r, 2), "l0").mixer for r in range(2)]
    hd = 16
    q = torch.cat([x.w_qkv[: 2 * hd] for x in s])
    k = torch.cat([x.w_qkv[2 * hd: 3 * hd] for x in s])
    v = torch.cat([x.w_qkv[3 * hd:] for x in s])
    assert torch.equal(torch.cat([q, k, v]), w.w_qkv)
    assert torch.equal(torch.cat([x.w_o for x in s], dim=1), w.w_o)


def test_deltanet_shards_keep_key_groups_together():
    m = ds4t.load("tiny-qwen")    # GDN: 2 key heads x 16, 4 value heads x 16
    w = m.layers[0].mixer
    s = [layer(m.layers[0], m.cfg, Part(r, 2), "l0").mixer for r in range(2)]
    assert s[0].w_in.shape == (w.w_in.shape[0] // 2, 64)
    # rank 1 holds key head 1: q rows 16..32 of the fused [q | k | v | z | b | a]
    assert torch.equal(s[1].w_in[:16], w.w_in[16:32])
    assert torch.equal(torch.cat([s[0].A_log, s[1].A_log]), w.A_log)
    assert torch.equal(torch.cat([x.w_out for x in s], dim=1), w.w_out)


def test_fp8_rows_keep_scales_and_columns_follow_blocks():
    w = quantize(torch.randn(40, 64), (16, 16))
    r = rows(w, [(8, 16), (32, 40)])
    assert torch.equal(r.dequantize(), torch.cat([w.dequantize()[8:16], w.dequantize()[32:40]]))
    c = cols(w, 32, 64, "x")
    assert torch.equal(c.dequantize(), w.dequantize()[:, 32:])
    with pytest.raises(ParallelError, match="not on the FP8 scale blocks of 16 columns"):
        cols(w, 24, 64, "layers.0.mixer.w_o")
