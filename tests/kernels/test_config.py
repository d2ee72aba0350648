"""ds4t.kernels.config: every kernel module declares its launch constants as ConfigTables.

The expected values below are what each launcher computed inline before its constants moved into
a table (hard-coded here from that code), on the GPU rule and on the interpreter rule.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch

import ds4t.kernels
from ds4t.backend import INTERPRET
from ds4t.kernels.config import ConfigTable

# module -> {attribute: ConfigTable.kernel}
EXPECTED = {
    "activation": {"ACTIVATION_CONFIGS": "activation"},
    "attention": {"ATTENTION_CONFIGS": "decode_attention", "SPLIT_SCHEDULES": "attention_splits",
                  "NORM_ROPE_CONFIGS": "norm_rope"},
    "conv": {"CONV_CONFIGS": "conv1d"},
    "embedding": {"EMBEDDING_CONFIGS": "embedding"},
    "gdn": {"GDN_CONFIGS": "gdn"},
    "linear": {"LINEAR_CONFIGS": "linear", "LINEAR_ROW_TILES": "linear_rows", "SPLITK_SUM_CONFIGS": "splitk_sum"},
    "mla": {"MLA_CONFIGS": "mla_decode", "WRITE_LATENT_CONFIGS": "write_latent",
            "MLA_SPLIT_SCHEDULES": "mla_splits"},
    "moe": {"MOE_CONFIGS": "moe", "MOE_COMBINE_CONFIGS": "moe_combine"},
    "norm": {"NORM_CONFIGS": "rms_norm"},
    "qlinear": {"QLINEAR_CONFIGS": "qlinear"},
    "qmoe": {"QMOE_CONFIGS": "qmoe"},
    "quant_blocks": {"GGUF_LAYOUTS": "gguf_layout"},
    "rope": {"ROPE_CONFIGS": "rope"},
    "router": {"ROUTER_CONFIGS": "router"},
    "sampling": {"SAMPLING_CONFIGS": "sampling"},
}


def _modules():
    """The top-level ds4t.kernels modules (the interp/ twins take their tiles from these)."""
    for info in pkgutil.iter_modules(ds4t.kernels.__path__):
        if not info.ispkg:
            yield info.name, importlib.import_module(f"ds4t.kernels.{info.name}")


def _tables(mod):
    return {k: v for k, v in vars(mod).items() if isinstance(v, ConfigTable)}


def test_every_kernel_module_has_its_tables():
    found = {name: {k: t.kernel for k, t in _tables(mod).items()} for name, mod in _modules()}
    assert {n: t for n, t in found.items() if t} == EXPECTED
    # config.tables() (what overridden() and the benchmarks look tables up in) finds the same ones
    from ds4t.kernels.config import tables

    assert set(tables()) == {kernel for attrs in EXPECTED.values() for kernel in attrs.values()}
    for name, mod in _modules():
        # launched kernels are named _name_kernel (docs/kernel-conventions.md); a module of @triton.jit
        # device helpers only (ds4t.kernels.splits) launches nothing. By name: under the interpreter
        # triton.jit does not return a JITFunction.
        has_kernels = any(k.startswith("_") and k.endswith("_kernel") and hasattr(v, "fn")
                          for k, v in vars(mod).items())
        if has_kernels:
            assert name in EXPECTED, f"ds4t.kernels.{name} launches kernels but declares no ConfigTable"
        for attr, table in _tables(mod).items():
            assert table.source.strip(), f"{name}.{attr} has no source"


def test_every_results_file_a_table_names_exists():
    """A table's ``source`` points at the measurement behind its entries: a renamed or never-written
    bench/results file leaves the entries unexplained."""
    import re
    from pathlib import Path

    from ds4t.kernels.config import tables

    root = Path(__file__).resolve().parents[2]
    named = {(name, p) for name, t in tables().items() for p in re.findall(r"bench/results/[\w.-]+\.md", t.source)}
    assert named, "no table names a results file"
    missing = sorted((name, p) for name, p in named if not (root / p).is_file())
    assert not missing, f"config table sources name missing files: {missing}"


def _rules(table):
    return {"gpu": table.gpu_rule, "interp": table.interp_rule}


def _fields(cfg, names):
    return tuple(getattr(cfg, n) for n in names)


def _m(name):
    return importlib.import_module(f"ds4t.kernels.{name}")


# (module, table, fields, key, expected GPU values, expected interpreter values)
CASES = [
    ("norm", "NORM_CONFIGS", ("rows", "block_d", "num_warps", "moe_warps"), (200,), (1, 256, 1, 0), (32, 256, 1, 0)),
    ("norm", "NORM_CONFIGS", ("rows", "block_d", "num_warps", "moe_warps"), (2048,), (1, 2048, 4, 0),
     (32, 2048, 4, 0)),
    ("norm", "NORM_CONFIGS", ("rows", "block_d", "num_warps", "moe_warps"), (7168,), (1, 8192, 4, 16),
     (32, 8192, 4, 16)),
    ("norm", "NORM_CONFIGS", ("rows", "block_d", "num_warps", "moe_warps"), (100000,), (1, 8192, 4, 16),
     (32, 65536, 4, 16)),
    ("attention", "NORM_ROPE_CONFIGS", ("heads", "min_rows", "num_warps"), (128,), (16, 64, 4), (16, 64, 4)),
    ("attention", "NORM_ROPE_CONFIGS", ("heads", "min_rows", "num_warps"), (256,), (8, 64, 4), (8, 64, 4)),
    ("activation", "ACTIVATION_CONFIGS", ("block_r", "block_c", "num_warps"), (333,), (1, 512, 4), (64, 512, 4)),
    ("activation", "ACTIVATION_CONFIGS", ("block_r", "block_c", "num_warps"), (20000,), (1, 2048, 4),
     (64, 16384, 4)),
    ("embedding", "EMBEDDING_CONFIGS", ("block_r", "block_d", "num_warps"), (100,), (1, 128, 4), (32, 128, 4)),
    ("embedding", "EMBEDDING_CONFIGS", ("block_r", "block_d", "num_warps"), (7168,), (1, 2048, 4),
     (32, 8192, 4)),
    ("sampling", "SAMPLING_CONFIGS", ("rows", "block_v", "num_warps"), (300,), (1, 512, 8), (64, 512, 4)),
    ("sampling", "SAMPLING_CONFIGS", ("rows", "block_v", "num_warps"), (151936,), (1, 4096, 8), (64, 4096, 4)),
    ("gdn", "GDN_CONFIGS", ("block_h", "block_k", "block_v", "num_warps"), (32, 128, 128, "dv"), (1, 128, 32, 4),
     (32, 128, 128, 4)),
    ("gdn", "GDN_CONFIGS", ("block_h", "block_k", "block_v", "num_warps"), (32, 128, 128, "dk"), (1, 128, 8, 1),
     (32, 128, 128, 4)),
    ("gdn", "GDN_CONFIGS", ("block_h", "block_k", "block_v", "num_warps"), (3, 100, 20, "dv"), (1, 128, 32, 4),
     (4, 128, 32, 4)),
    ("gdn", "GDN_CONFIGS", ("block_h", "block_k", "block_v", "num_warps"), (3, 100, 5, "dk"), (1, 128, 8, 1),
     (4, 128, 8, 4)),
    # whole heads (the decode tile that may compute the gated norm): off on the GPU, on in the interpreter
    ("gdn", "GDN_CONFIGS", ("block_h", "block_k", "block_v", "num_warps", "norm_rows"), (32, 128, 128, "dk", True),
     (1, 128, 128, 8, 0), (32, 128, 128, 4, 1 << 16)),
    ("conv", "CONV_CONFIGS", ("block_c", "block_t"), (100,), (128, 16), (128, 64)),
    ("conv", "CONV_CONFIGS", ("block_c", "block_t"), (8192,), (256, 16), (8192, 64)),
    ("mla", "WRITE_LATENT_CONFIGS", ("num_warps",), (64,), (1,), (4,)),
    ("mla", "WRITE_LATENT_CONFIGS", ("num_warps",), (256,), (2,), (4,)),
    ("mla", "WRITE_LATENT_CONFIGS", ("num_warps",), (512,), (4,), (4,)),
    ("mla", "WRITE_LATENT_CONFIGS", ("num_warps",), (1000,), (4,), (4,)),
    ("rope", "ROPE_CONFIGS", ("block_h", "block_half", "block_p"), (32, 128, 128), (2, 64, 1), (32, 64, 1)),
    ("rope", "ROPE_CONFIGS", ("block_h", "block_half", "block_p"), (128, 192, 64), (4, 32, 128),
     (128, 32, 128)),
    ("rope", "ROPE_CONFIGS", ("block_h", "block_half", "block_p"), (16, 256, 64), (4, 32, 256), (16, 32, 256)),
    ("router", "ROUTER_CONFIGS", ("rows",), (512,), (1,), (16,)),
    ("moe", "MOE_COMBINE_CONFIGS", ("rows", "block_d"), (2048,), (1, 256), (16, 2048)),
    ("moe", "MOE_COMBINE_CONFIGS", ("rows", "block_d"), (100,), (1, 128), (16, 128)),
    # the interpreter's dot materialises [heads, R, tokens] (<= 2^20 elements): 16 heads at R = 512
    ("mla", "MLA_CONFIGS", ("block_h", "block_n", "merge_heads", "num_warps", "num_stages", "merge_warps", "fuse_rows"),
     (128, 512, 64, 256), (32, 64, 8, 4, 2, 4, 512), (16, 128, 128, 4, 2, 4, 16)),
    ("mla", "MLA_CONFIGS", ("block_h", "fuse_rows"), (16, 512, 64, 256), (16, None), (16, 16)),
    # the Q4_K / Q5_K scale plane: untimed on the GPU (off), on in the interpreter for bf16 activations
    ("quant_blocks", "GGUF_LAYOUTS", ("scale_plane",), ("Q4_K", torch.bfloat16), (False,), (True,)),
    ("quant_blocks", "GGUF_LAYOUTS", ("scale_plane",), ("Q4_K", torch.float32), (False,), (False,)),
    ("quant_blocks", "GGUF_LAYOUTS", ("scale_plane",), ("Q5_K", torch.bfloat16), (False,), (True,)),
    ("quant_blocks", "GGUF_LAYOUTS", ("scale_plane",), ("Q8_0", torch.bfloat16), (False,), (False,)),
    # interior tiles unmasked on the GPU for d 256 only (2026-12-05-h200-prefill-runs.md)
    ("attention", "ATTENTION_CONFIGS", ("run_fuse_rows", "run_interior", "run_peel"), (64, 256, 256),
     (512, True, False), (16, True, True)),
    ("attention", "ATTENTION_CONFIGS", ("run_fuse_rows", "run_interior", "run_peel"), (64, 128, 128),
     (1024, False, False), (16, True, True)),
    ("mla", "MLA_CONFIGS", ("block_h", "block_n"), (4, 16, 8, 128), (16, 64), (16, 128)),
    ("linear", "SPLITK_SUM_CONFIGS", ("min_block", "max_block", "num_warps"), (4096,), (1024, 1024, 4),
     (16, 1 << 16, 4)),
]


@pytest.mark.parametrize("mod,attr,fields,key,gpu,interp", CASES,
                         ids=[f"{c[1]}{c[3]}" for c in CASES])
def test_rules_give_the_inline_values(mod, attr, fields, key, gpu, interp):
    table = getattr(_m(mod), attr)
    rules = _rules(table)
    assert _fields(rules["gpu"](*key), fields) == gpu
    assert _fields(rules["interp"](*key), fields) == interp
    cfg = table(*key)    # this backend's answer
    assert _fields(cfg, fields) == (interp if INTERPRET else gpu)
    assert dataclasses.is_dataclass(cfg) and type(cfg).__dataclass_params__.frozen


def test_forced_overrides_both_rules_and_restores():
    table = _m("norm").NORM_CONFIGS
    before = (table.gpu, table.gpu_rule, table.interp_rule)
    cfg = _m("norm").NormConfig(rows=1, block_d=16, num_warps=1)
    with table.forced(lambda D: cfg):
        assert table(4096) is cfg
    assert (table.gpu, table.gpu_rule, table.interp_rule) == before


def test_gpu_entries_run_the_gpu_table_under_forced():
    """``gpu_entries()``: the GPU table's entries as a rule, copied before ``forced`` empties the table -- every
    key with an entry gets that entry on either backend, a key without one None; after the block the table is
    as it was."""
    table = _m("moe").MOE_CONFIGS
    entries = dict(table.gpu)
    with table.forced(table.gpu_entries()):
        assert table.gpu == {}
        for key, cfg in entries.items():
            assert table(*(key if isinstance(key, tuple) else (key,))) is cfg
        assert table("no such kernel", "fp8") is None
    assert table.gpu == entries


# ----------------------------------------------------------------------------- overrides (benchmarks)


def test_overridden_replaces_fields_then_restores_and_clears_caches(tmp_path):
    """config.overridden: an entry's fields replaced on the table's current config (an entry, or the rule
    for a key without one), dtype keys from "torch.*" strings, lru-cached lookups cleared on the way in
    and out, everything restored after; from a dict or a JSON file."""
    import json

    import torch

    from ds4t.kernels import linear as L
    from ds4t.kernels import moe as M
    from ds4t.kernels.config import overridden, tables

    assert tables()["moe"] is M.MOE_CONFIGS and tables()["linear"] is L.LINEAR_CONFIGS
    fp8_key = (300, 200, torch.float8_e4m3fn, 128, torch.bfloat16)   # not in the table: the rule's config
    before_moe, before_gpu = M.MOE_CONFIGS.gpu[("gate_up", "fp8")], dict(L.LINEAR_CONFIGS.gpu)
    rule_cfg = L.LINEAR_CONFIGS.gpu_rule(*fp8_key)
    L.linear_config(300, 200, torch.float8_e4m3fn, torch.bfloat16, 128)   # cached
    spec = {"moe": [{"key": ["gate_up", "fp8"], "fields": {"split": 2}}],
            "linear": [{"key": [300, 200, "torch.float8_e4m3fn", 128, "torch.bfloat16"], "fields": {"split": 3}}]}
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(spec))
    for arg in (spec, str(path)):
        with overridden(arg) as plan:
            assert len(plan) == 2
            assert M.MOE_CONFIGS.gpu[("gate_up", "fp8")] == dataclasses.replace(before_moe, split=2)
            assert L.LINEAR_CONFIGS.gpu[fp8_key] == dataclasses.replace(rule_cfg, split=3)
            if not INTERPRET:   # the interpreter reads its own rule
                assert L.linear_config(300, 200, torch.float8_e4m3fn, torch.bfloat16, 128).split == 3
        assert M.MOE_CONFIGS.gpu[("gate_up", "fp8")] == before_moe and L.LINEAR_CONFIGS.gpu == before_gpu
        assert L.linear_config.cache_info().currsize == 0


def test_overridden_tiles_replace_a_tile_tuple_then_restore():
    """A table of tile tuples (linear_rows) takes "tiles": each item the rule's first tile with its fields,
    [] for none; a key without a tile to start from is refused before anything changes."""
    import torch

    from ds4t.kernels import linear as L
    from ds4t.kernels.config import overridden

    first = L._gpu_row_tiles(7168, 256, torch.float32)[0]
    before = dict(L.LINEAR_ROW_TILES.gpu)
    spec = {"linear_rows": [{"key": [7168, 256, "torch.float32"], "tiles": [{"block_n": 128}, {"min_rows": 512}]},
                            {"key": [5120, 160, "torch.float32"], "tiles": []}]}
    with overridden(spec):
        assert L.LINEAR_ROW_TILES.gpu[(7168, 256, torch.float32)] == (
            dataclasses.replace(first, block_n=128), dataclasses.replace(first, min_rows=512))
        assert L.LINEAR_ROW_TILES.gpu[(5120, 160, torch.float32)] == ()
    assert L.LINEAR_ROW_TILES.gpu == before
    with pytest.raises(ValueError, match="tiles"):
        with overridden({"linear_rows": [{"key": [300, 200, "torch.float8_e4m3fn", 128, "torch.bfloat16"],
                                          "tiles": [{"block_n": 64}]}]}):
            pass
    with pytest.raises(ValueError, match="tiles"):
        with overridden({"moe": [{"key": ["gate_up", "fp8"], "tiles": []}]}):
            pass
    assert L.LINEAR_ROW_TILES.gpu == before


def test_overridden_rejects_unknown_tables_fields_and_keys():
    from ds4t.kernels import moe as M
    from ds4t.kernels.config import overridden

    before = dict(M.MOE_CONFIGS.gpu)
    with pytest.raises(KeyError, match="no config table 'nope'"):
        with overridden({"nope": []}):
            pass
    with pytest.raises(TypeError):
        with overridden({"moe": [{"key": ["gate_up", "fp8"], "fields": {"no_such_field": 1}}]}):
            pass
    with pytest.raises(ValueError, match="not a torch dtype"):
        with overridden({"linear": [{"key": [1, 2, "torch.nonsense"], "fields": {}}]}):
            pass
    assert M.MOE_CONFIGS.gpu == before


def test_with_fields_patches_the_keys_it_is_told_of_and_restores_them():
    """``ConfigTable.with_fields``: every GPU key ``where`` accepts gets its config (entry or rule) with the fields
    replaced, the others keep theirs, and the table is as before after the block (also when it raises)."""
    L = _m("linear")
    fp8 = (7168, 18432, torch.float8_e4m3fn, 128, torch.bfloat16)   # a table entry
    ruled = (4096, 4096, torch.float8_e4m3fn, 128, torch.bfloat16)  # the rule's
    bf16 = (2048, 12352, torch.bfloat16)
    before = {k: (L.LINEAR_CONFIGS.gpu.get(k) or L.LINEAR_CONFIGS.gpu_rule(*k)) for k in (fp8, ruled, bf16)}
    assert not any(c.tma for c in before.values())
    with pytest.raises(RuntimeError):
        with L.LINEAR_CONFIGS.with_fields({"tma": True}, lambda *key: torch.float8_e4m3fn in key) as t:
            assert t.gpu_rule(*fp8) == dataclasses.replace(before[fp8], tma=True)
            assert t.gpu_rule(*ruled) == dataclasses.replace(before[ruled], tma=True)
            assert t.gpu_rule(*bf16) == before[bf16]   # negative control: a key ``where`` refuses
            raise RuntimeError
    assert {k: (L.LINEAR_CONFIGS.gpu.get(k) or L.LINEAR_CONFIGS.gpu_rule(*k)) for k in before} == before
    with L.LINEAR_CONFIGS.with_fields({"no_such_field": 1}, lambda *key: True) as t:
        with pytest.raises(TypeError):
            t.gpu_rule(*bf16)

