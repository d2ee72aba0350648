"""The sharding rules: which rows / columns of each fused weight a rank keeps. Written once per
weight type (every family that uses the type shares its rule), on the layouts the families build at
load (docs/design.md, "Model semantics"; docs/parallel.md).

Megatron-style pairs: a column-parallel matrix (output rows split: q/k/v, gate/up, a head's input
projections) feeds per-rank work that needs nothing from other ranks (a head's attention, an MLP
column), and a row-parallel matrix (input columns split: o_proj, down, out_proj) turns it into a
partial sum of the full hidden vector, which :mod:`ds4t.parallel.comm` reduces. Experts are not
cut: each rank holds E / K whole experts (expert parallel). Biases of row-parallel layers stay on
rank 0 only (added once). Everything else (norms, routers, MLA's down-projection) is replicated.

Every kept slice is copied into storage of its own (``weights.cat``), so the full tensor it came
from can be freed: a rank never holds more than its shard plus the layer being loaded.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from ds4t.kernels import weights
from ds4t.kernels.quant_blocks import GGUFWeight
from ds4t.kernels.weights import FP8Weight, Weight
from ds4t.parallel import split
from ds4t.parallel.group import ParallelError

Ranges = Sequence[Tuple[int, int]]


# ---------------------------------------------------------------------------- slicing one weight
def rows(w: Weight, ranges: Ranges) -> Weight:
    """Rows ``[a, b)`` for each range, concatenated in order (dim -2 of a matrix, dim 0 of a vector),
    in fresh storage. FP8 rows keep their per-row scales."""
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return torch.cat([w[a:b] for a, b in ranges]).contiguous()
    return weights.cat([w[..., a:b, :] for a, b in ranges], dim=-2)   # FP8Weight indexes data and scale alike


def cols(w: Weight, a: int, b: int, what: str) -> Weight:
    """Columns [a, b) (the input dim K) in fresh storage. An FP8 weight is cut on its scale blocks
    only: ``a`` a multiple of block_k, ``b`` too or the end of K; GGUF blocks on their block width;
    else ParallelError naming ``what``."""
    if isinstance(w, torch.Tensor):
        return w[..., a:b].clone(memory_format=torch.contiguous_format)
    if isinstance(w, GGUFWeight):   # blocks of qk columns, bpb bytes each, along K
        f, K = w.format, w.shape[-1]
        if a % f.qk or b % f.qk:
            raise ParallelError(f"{what}: tp slices its input dim at [{a}, {b}), not on the {w.qtype} blocks of "
                                f"{f.qk} columns; use a tp whose per-rank width is a multiple of {f.qk}")
        return w.cols(a, b)   # repacked planes: cut as ggml blocks and repacked, in storage of its own
    bk, K = w.block_k, w.shape[-1]
    if a % bk or (b % bk and b != K):
        raise ParallelError(f"{what}: tp slices its input dim at [{a}, {b}), not on the FP8 scale blocks of "
                            f"{bk} columns; use a tp whose per-rank width is a multiple of {bk}, or float weights")
    return dataclasses.replace(w, data=w.data[..., a:b].contiguous(),
                               scale=w.scale[..., a // bk: -(-b // bk)].contiguous())


def _map_tensors(w, fn):
    """A wrapped weight (FP8, GGUF blocks: a dataclass of tensors) with ``fn`` applied to each tensor field."""
    return dataclasses.replace(w, **{f.name: fn(v) for f in dataclasses.fields(w)
                                     if isinstance(v := getattr(w, f.name), torch.Tensor)})


def own(w: Optional[Weight]) -> Optional[Weight]:
    """``w`` (a view) in storage of its own, or None."""
    if w is None:
        return None
    if isinstance(w, torch.Tensor):
        return w.clone(memory_format=torch.contiguous_format)
    return _map_tensors(w, lambda v: v.clone(memory_format=torch.contiguous_format))


def _heads(h0: int, h1: int, dim: int, base: int = 0) -> Tuple[int, int]:
    """Row range of heads [h0, h1) of width ``dim`` in a block starting at row ``base``."""
    return base + h0 * dim, base + h1 * dim


def _opt(b, fn):
    return None if b is None else fn(b)


# ---------------------------------------------------------------------------- the rules
@dataclasses.dataclass(frozen=True)
class Part:
    """Rank ``rank`` of ``size``."""
    rank: int
    size: int

    def even(self, n: int, what: str) -> Tuple[int, int]:
        return split.even(n, self.rank, self.size, what)

    def first(self, b):
        """A row-parallel bias: kept on rank 0 (added once), None elsewhere."""
        return b if self.rank == 0 else None


def gqa(w, c, p: Part, where: str):
    """GQA attention (GLM-4.5, llama, Qwen3 dense): w_qkv rows [q | k | v] by heads, w_o columns by
    q heads. ``c``: the family config (num_heads, num_kv_heads, head_dim)."""
    H, KV, hd = c.num_heads, c.num_kv_heads, c.head_dim
    h0, h1 = p.even(H, "num_attention_heads")
    k0, k1 = split.kv_heads(H, KV, p.rank, p.size)
    r = [_heads(h0, h1, hd), _heads(k0, k1, hd, H * hd), _heads(k0, k1, hd, (H + KV) * hd)]
    return dataclasses.replace(
        w, w_qkv=rows(w.w_qkv, r), b_qkv=_opt(w.b_qkv, lambda b: rows(b, r)),
        w_o=cols(w.w_o, h0 * hd, h1 * hd, where + ".w_o"), b_o=p.first(w.b_o))


def gated_attention(w, c, p: Part, where: str):
    """Qwen3-Next gated attention: w_qkv rows [q | gate | k | v] by heads, w_o columns by q heads."""
    H, KV, hd = c.num_heads, c.num_kv_heads, c.head_dim
    h0, h1 = p.even(H, "num_attention_heads")
    k0, k1 = split.kv_heads(H, KV, p.rank, p.size)
    r = [_heads(h0, h1, hd), _heads(h0, h1, hd, H * hd), _heads(k0, k1, hd, 2 * H * hd),
         _heads(k0, k1, hd, (2 * H + KV) * hd)]
    return dataclasses.replace(
        w, w_qkv=rows(w.w_qkv, r), b_qkv=_opt(w.b_qkv, lambda b: rows(b, r)),
        w_o=cols(w.w_o, h0 * hd, h1 * hd, where + ".w_o"), b_o=p.first(w.b_o))


def gated_deltanet(w, c, p: Part, where: str):
    """Qwen3-Next Gated DeltaNet, split by key-head groups (a key head and the value heads that read
    it stay together): w_in rows [q | k | v | z | b | a], conv channels [q | k | v], A_log / dt_bias
    by value head, w_out columns by value head; the output norm's gain is per head dim (replicated)."""
    hk, hv, dk, dv = c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim
    g0, g1 = p.even(hk, "linear_num_key_heads")
    v0, v1 = g0 * (hv // hk), g1 * (hv // hk)
    cd = 2 * hk * dk + hv * dv
    conv = [_heads(g0, g1, dk), _heads(g0, g1, dk, hk * dk), _heads(v0, v1, dv, 2 * hk * dk)]
    r = conv + [_heads(v0, v1, dv, cd), _heads(v0, v1, 1, cd + hv * dv), _heads(v0, v1, 1, cd + hv * dv + hv)]
    return dataclasses.replace(
        w, w_in=rows(w.w_in, r), conv_w=rows(w.conv_w, conv), A_log=own(w.A_log[v0:v1]),
        dt_bias=own(w.dt_bias[v0:v1]), w_out=cols(w.w_out, v0 * dv, v1 * dv, where + ".w_out"))


def mla(w, c, p: Part, where: str):
    """DeepSeek-V3 MLA by heads: q_b rows [nope | rope] (or, without q_lora_rank, the q part of the fused
    down-projection), the absorbed W_UK^T / W_UV per head, o_proj columns. The latent down-projection
    (c_kv, k_pe) and the latent cache are shared by all heads: replicated."""
    H, dn, dr, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    h0, h1 = p.even(H, "num_attention_heads")
    q = [_heads(h0, h1, dn), _heads(h0, h1, dr, H * dn)]
    w_a, b_a, w_qb = w.w_a, w.b_a, w.w_qb
    if w_qb is not None:
        w_qb = rows(w_qb, q)
    else:   # the q part sits in w_a: [q nope | q rope | c_kv | k_pe]
        rest = [(H * (dn + dr), w_a.shape[-2])]
        w_a = rows(w_a, q + rest)
        b_a = _opt(b_a, lambda b: rows(b, q + rest))
    return dataclasses.replace(
        w, w_a=w_a, b_a=b_a, w_qb=w_qb, w_uk_t=own(w.w_uk_t[h0:h1]), w_uv=own(w.w_uv[h0:h1]),
        w_o=cols(w.w_o, h0 * dv, h1 * dv, where + ".w_o"), b_o=p.first(w.b_o))


def _col_unit(w: Weight) -> int:
    """Columns (input dim) a quantized weight can only be cut between multiples of: FP8 scale blocks,
    GGUF blocks; 1 for a float tensor."""
    if isinstance(w, FP8Weight):
        return w.block_k
    if isinstance(w, GGUFWeight):
        return w.format.qk
    return 1


def dense_mlp(w, p: Part, where: str):
    """SwiGLU: gate_up rows [gate | up] by intermediate column, down's columns the same. Evenly; or, when
    down is quantized and an even share is not a whole number of its blocks (GLM-4.5's 1536-wide shared
    expert in FP8 over 8 ranks: 192 columns), in whole blocks, as evenly as they allow (2 or 1 blocks of
    128 a rank): the partial sums still add up in rank order."""
    i = w.gate_up.shape[-2] // 2
    unit = _col_unit(w.down)
    if unit > 1 and (i % p.size or (i // p.size) % unit):
        a, b = split.blocks(i, unit, p.rank, p.size, f"the MLP width of {where}")
    else:
        a, b = p.even(i, f"the MLP width of {where}")
    return dataclasses.replace(w, gate_up=rows(w.gate_up, [(a, b), (i + a, i + b)]),
                               down=cols(w.down, a, b, where + ".down"))


def moe(w, p: Part, where: str):
    """Expert parallel: rank r keeps routed experts [r E/K, (r+1) E/K) whole (``expert_range``; the
    router stays whole on every rank, so all ranks pick the same experts). The shared expert (fused
    as expert E at load, or separate) is split like a dense MLP and runs beside the routed ones."""
    from ds4t.models.blocks import DenseMLP

    E = w.w_gate.shape[0] - (w.shared_index is not None)
    if w.expert_range is not None:   # read as this rank's experts already (WeightReader.expert_range)
        lo, hi = w.expert_range
        if hi - lo != E:
            raise ParallelError(f"{where}: {E} experts stacked for the range [{lo}, {hi})")
        local = slice(0, E)
    else:
        lo, hi = p.even(E, "the number of routed experts")
        local = slice(lo, hi)
    shared = None
    if w.shared_index is not None:
        s = w.shared_index
        shared = DenseMLP(weights.cat([w.w_gate[s], w.w_up[s]]), w.w_down[s])
    elif w.shared_gate_up is not None:
        shared = DenseMLP(w.shared_gate_up, w.shared_down)
    if shared is not None:
        shared = dense_mlp(shared, p, where + ".shared")
    return dataclasses.replace(
        w, w_gate=own(w.w_gate[local]), w_up=own(w.w_up[local]), w_down=own(w.w_down[local]),
        shared_gate_up=shared.gate_up if shared else None, shared_down=shared.down if shared else None,
        shared_index=None, expert_range=(lo, hi))


def layer(lw, c, p: Part, where: str):
    """One decoder layer's shard: its mixer by heads, its FFN (dense columns or experts)."""
    from ds4t.models.blocks import DenseMLP, GQAAttentionWeights, Layer, MoEWeights
    from ds4t.models.deepseek import MLAWeights
    from ds4t.models.qwen import GatedAttentionWeights, GatedDeltaNetWeights

    mixers = {GQAAttentionWeights: gqa, GatedAttentionWeights: gated_attention,
              GatedDeltaNetWeights: gated_deltanet, MLAWeights: mla}
    rule = mixers.get(type(lw.mixer))
    if rule is None:
        raise ParallelError(f"{where}: no sharding rule for a {type(lw.mixer).__name__} mixer")
    if isinstance(lw.ffn, MoEWeights):
        f = moe(lw.ffn, p, where + ".ffn")
    elif isinstance(lw.ffn, DenseMLP):
        f = dense_mlp(lw.ffn, p, where + ".ffn")
    else:
        raise ParallelError(f"{where}: no sharding rule for a {type(lw.ffn).__name__} FFN")
    return Layer(rule(lw.mixer, c, p, where + ".mixer"), f)


# ---------------------------------------------------------------------------- the config
def check_config(c, p: Part) -> None:
    """Errors for a tp that cannot shard this config, before any weight is read."""
    p.even(c.num_heads, "num_attention_heads")
    if hasattr(c, "num_kv_heads"):
        split.kv_heads(c.num_heads, c.num_kv_heads, p.rank, p.size)
    if hasattr(c, "lin_k_heads"):
        p.even(c.lin_k_heads, "linear_num_key_heads")
    moe_cfg = getattr(c, "ffn", c)
    if getattr(moe_cfg, "num_experts", 0):
        p.even(moe_cfg.num_experts, "the number of routed experts")


def local_config(c, p: Part):
    """The family config as one rank sees it: its heads only (what the mixers and the state specs read).
    Everything else (hidden size, vocabulary, expert count of the router) stays global."""
    names = {f.name for f in dataclasses.fields(c)}
    new = {"num_heads": c.num_heads // p.size}
    if "num_kv_heads" in names:
        k0, k1 = split.kv_heads(c.num_heads, c.num_kv_heads, p.rank, p.size)
        new["num_kv_heads"] = k1 - k0
    if "lin_k_heads" in names:
        new["lin_k_heads"] = c.lin_k_heads // p.size
        new["lin_v_heads"] = c.lin_v_heads // p.size
    return dataclasses.replace(c, **new)


def vocab_rows(table: Weight, p: Part) -> Weight:
    """Rows of an embedding / LM head [V, D] this rank holds, padded with zero rows to ceil(V / K). A
    quantized LM head (FP8, GGUF blocks) keeps its format: its rows are sliced, and the padding rows have
    zero values and zero scales, so they decode to 0 like a float table's."""
    lo, hi, n = split.vocab(table.shape[0], p.rank, p.size)
    if isinstance(table, torch.Tensor):
        out = torch.zeros((n, table.shape[1]), dtype=table.dtype, device=table.device)
        out[: hi - lo] = table[lo:hi]
        return out
    part = table[lo:hi]
    if n == hi - lo:
        return part
    first = table[:1]
    zero = _map_tensors(first, lambda v: torch.zeros((n - (hi - lo), *v.shape[1:]), dtype=v.dtype, device=v.device))
    return weights.cat([part, zero], dim=-2)
