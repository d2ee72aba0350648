"""Qwen3-Next (``model_type`` qwen3_next): Gated DeltaNet + gated attention + MoE.

Layer i is full attention iff layer_types[i] == "full_attention" (default: (i+1) %
full_attention_interval == 0), else Gated DeltaNet. Norms are zero-centred (x̂·(1+w)).
Projections are fused at load time: GDN in_proj_qkvz + in_proj_ba become one linear whose
output is [q | k | v | z | b | a] (HF interleaves them per key-head group); attention q/k/v
become one linear with output [q | gate | k | v]; the MoE router and the shared-expert gate
become one linear [E+1, D].
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from ds4t.kernels import gdn, ops, weights
from ds4t.kernels.weights import Weight
from ds4t.kernels.rope import default_inv_freq
from ds4t.models.base import CTX, StateSpec, StepBatch
from ds4t.models.blocks import (AttentionProducts, DenseMLP, Layer, Output, Projection, RouterConfig,
                               ffn, fused_linear, moe_weights, narrow_store, products_kwargs, runs_hint)
from ds4t.models.checkpoint import ConfigError, attention_heads, require, rope_params
from ds4t.models.decoder import DecoderModel, decoder_tensors
from ds4t.models.mtp import MTPNames, mtp_layers


@dataclasses.dataclass
class QwenConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: List[str]
    eps: float
    # gated attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    # gated delta net
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    # mlp / moe
    intermediate_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: List[bool]
    max_position: int
    tie_embeddings: bool
    mtp_layers: int = 0   # mtp_num_hidden_layers (ds4t.models.mtp: the first is loaded)

    def kind(self, i: int) -> str:
        """Layer i's mixer; i == num_layers is the MTP module's layer (gated attention)."""
        return self.layer_types[i] if i < self.num_layers else "full_attention"

    def sparse(self, i: int) -> bool:
        """Layer i holds experts; the MTP module's layer does whenever the model has experts."""
        return self.sparse_layers[i] if i < self.num_layers else self.num_experts > 0

    @classmethod
    def from_dict(cls, c: dict) -> "QwenConfig":
        n = require(c, "num_hidden_layers", int)
        types = c.get("layer_types")
        if types is None:
            interval = c.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
            raise ConfigError(f"layer_types {types!r} must list {n} of full_attention/linear_attention")
        heads, kv, head_dim, hidden = attention_heads(c)
        rp = rope_params(c)
        if rp["rope_type"] != "default":
            raise ConfigError(f"rope_type {rp['rope_type']!r} not supported for qwen3_next yet")
        rotary = int(head_dim * rp.get("partial_rotary_factor", 1.0))
        num_experts = c.get("num_experts", 0) or 0
        step = c.get("decoder_sparse_step", 1) or 1
        mlp_only = set(c.get("mlp_only_layers") or [])
        sparse = [(i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n)]
        top_k = c.get("num_experts_per_tok", 0)
        if num_experts and not 1 <= top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")
        lk, lv = require(c, "linear_num_key_heads", int), require(c, "linear_num_value_heads", int)
        if lv % lk:
            raise ConfigError(f"linear_num_value_heads {lv} not a multiple of linear_num_key_heads {lk}")
        return cls(
            vocab_size=require(c, "vocab_size", int), hidden_size=hidden, num_layers=n, layer_types=list(types),
            eps=c.get("rms_norm_eps", 1e-6), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rotary_dim=rotary, rope_theta=float(rp["rope_theta"]), attention_bias=bool(c.get("attention_bias", False)),
            lin_k_heads=lk, lin_v_heads=lv, lin_k_dim=require(c, "linear_key_head_dim", int),
            lin_v_dim=require(c, "linear_value_head_dim", int), conv_kernel=c.get("linear_conv_kernel_dim", 4),
            intermediate_size=c.get("intermediate_size", 0), num_experts=num_experts,
            top_k=top_k, moe_intermediate_size=c.get("moe_intermediate_size", 0),
            shared_intermediate_size=c.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=bool(c.get("norm_topk_prob", True)), sparse_layers=sparse,
            max_position=c.get("max_position_embeddings", 4096), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            mtp_layers=mtp_layers(c, "mtp_num_hidden_layers"),
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


def expected_tensors(c: QwenConfig, mtp: Optional[bool] = None, source=None) -> Dict[str, tuple]:
    """Checkpoint tensor names and shapes implied by the config (HF save_pretrained layout); with
    ``mtp`` (default: the config declares an MTP module) the ``mtp.*`` module too."""
    return decoder_tensors(c, _layer_tensors, MTPNames.qwen3_next(), c.mtp_layers if mtp is None else mtp, source)


def _layer_tensors(c: QwenConfig, t: Dict[str, tuple], p: str, i: int) -> None:
    """Layer i's mixer and MLP tensors under prefix ``p`` (i == num_layers: the MTP layer)."""
    D = c.hidden_size
    if c.kind(i) == "linear_attention":
        a = p + "linear_attn."
        hk, hv, dk, dv = c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim
        t[a + "in_proj_qkvz.weight"] = (2 * hk * dk + 2 * hv * dv, D)
        t[a + "in_proj_ba.weight"] = (2 * hv, D)
        t[a + "conv1d.weight"] = (c.conv_dim, 1, c.conv_kernel)
        t[a + "A_log"] = (hv,)
        t[a + "dt_bias"] = (hv,)
        t[a + "norm.weight"] = (dv,)
        t[a + "out_proj.weight"] = (D, hv * dv)
    else:
        a = p + "self_attn."
        H, KV, hd = c.num_heads, c.num_kv_heads, c.head_dim
        t[a + "q_proj.weight"] = (2 * H * hd, D)
        t[a + "k_proj.weight"] = (KV * hd, D)
        t[a + "v_proj.weight"] = (KV * hd, D)
        t[a + "o_proj.weight"] = (D, H * hd)
        if c.attention_bias:
            t[a + "q_proj.bias"], t[a + "k_proj.bias"] = (2 * H * hd,), (KV * hd,)
            t[a + "v_proj.bias"], t[a + "o_proj.bias"] = (KV * hd,), (D,)
        t[a + "q_norm.weight"] = (hd,)
        t[a + "k_norm.weight"] = (hd,)
    m = p + "mlp."
    if c.sparse(i):
        E, I = c.num_experts, c.moe_intermediate_size
        t[m + "gate.weight"] = (E, D)
        for e in range(E):
            t[m + f"experts.{e}.gate_proj.weight"] = (I, D)
            t[m + f"experts.{e}.up_proj.weight"] = (I, D)
            t[m + f"experts.{e}.down_proj.weight"] = (D, I)
        if c.shared_intermediate_size:
            Is = c.shared_intermediate_size
            t[m + "shared_expert.gate_proj.weight"] = (Is, D)
            t[m + "shared_expert.up_proj.weight"] = (Is, D)
            t[m + "shared_expert.down_proj.weight"] = (D, Is)
            t[m + "shared_expert_gate.weight"] = (1, D)
    else:
        I = c.intermediate_size
        t[m + "gate_proj.weight"] = (I, D)
        t[m + "up_proj.weight"] = (I, D)
        t[m + "down_proj.weight"] = (D, I)


@dataclasses.dataclass(frozen=True, eq=False)
class GatedAttentionWeights:
    """A gated-attention layer's weights. Matrices in the model dtype, the rest fp32."""

    w_qkv: Weight             # [(2H + 2KV)·hd, D]: rows [q all heads | gate all heads | k | v]
    b_qkv: Optional[torch.Tensor]   # [(2H + 2KV)·hd], same row order; with attention_bias only
    q_norm: torch.Tensor            # [hd], zero-centred RMSNorm gain
    k_norm: torch.Tensor            # [hd], zero-centred RMSNorm gain
    w_o: Weight               # [D, H·hd]
    b_o: Optional[torch.Tensor]     # [D]; with attention_bias only


@dataclasses.dataclass(frozen=True, eq=False)
class GatedDeltaNetWeights:
    """A Gated DeltaNet layer's weights (Hk/Hv key/value heads of dims dk/dv; conv_dim =
    2·Hk·dk + Hv·dv). Matrices in the model dtype, the rest fp32."""

    w_in: Weight      # [conv_dim + Hv·dv + 2·Hv, D]: rows [q | k | v | z | b | a]
    conv_w: torch.Tensor    # [conv_dim, conv_kernel]: depthwise causal conv over [q | k | v]
    A_log: torch.Tensor     # [Hv]: the decay g = -exp(A_log)·softplus(a + dt_bias)
    dt_bias: torch.Tensor   # [Hv]
    norm_w: torch.Tensor    # [dv]: the gated output norm's gain (plain x̂·w, not zero-centred)
    w_out: Weight     # [D, Hv·dv]


def _gdn_row_order(c: QwenConfig):
    """Row permutations turning HF's per-key-head-group interleave into [q|k|v|z] and [b|a]."""
    hk, dk, dv, r = c.lin_k_heads, c.lin_k_dim, c.lin_v_dim, c.lin_v_heads // c.lin_k_heads
    group = 2 * dk + 2 * r * dv
    q = [g * group + j for g in range(hk) for j in range(dk)]
    k = [g * group + dk + j for g in range(hk) for j in range(dk)]
    v = [g * group + 2 * dk + j for g in range(hk) for j in range(r * dv)]
    z = [g * group + 2 * dk + r * dv + j for g in range(hk) for j in range(r * dv)]
    b = [g * 2 * r + j for g in range(hk) for j in range(r)]
    a = [g * 2 * r + r + j for g in range(hk) for j in range(r)]
    return torch.tensor(q + k + v + z), torch.tensor(b + a)


def _q_gate_order(c: QwenConfig):
    """HF q_proj emits [q_h | gate_h] per head; reorder rows to [q all heads | gate all heads]."""
    H, hd = c.num_heads, c.head_dim
    q = [h * 2 * hd + j for h in range(H) for j in range(hd)]
    g = [h * 2 * hd + hd + j for h in range(H) for j in range(hd)]
    return torch.tensor(q + g)


class QwenModel(DecoderModel):
    family = "qwen3_next"
    zero_centered_norms = True
    attention_products = AttentionProducts()

    def __init__(self, cfg: dict, source, device, dtype: torch.dtype, name: str = "qwen3_next", progress=None,
                 attention_products: str = "split"):
        c = QwenConfig.from_dict(cfg)
        self.attention_products = attention_products
        self._init_stack(c, name, device, dtype, source)
        self._read_checkpoint(source, dtype, progress, MTPNames.qwen3_next(),
                              lambda mtp: expected_tensors(c, mtp=mtp, source=source), self._load_layer)
        self.router_cfg = RouterConfig("softmax", c.num_experts, c.top_k, c.norm_topk_prob)
        self.inv_freq = default_inv_freq(c.rotary_dim, c.rope_theta).to(self.device)
        self._kept = {}   # (layer, slot) -> (conv history, chunk inputs, per-token states): see rollback
        super().__init__()

    def _load_layer(self, get, p: str, i: int) -> Layer:
        """Layer i's weights under checkpoint prefix ``p`` (i == num_layers: the MTP layer)."""
        c, f32 = self.cfg, torch.float32
        qkvz_order, ba_order = _gdn_row_order(c)
        qg_order = _q_gate_order(c)
        if c.kind(i) == "linear_attention":
            a = p + "linear_attn."
            qkvz = get(a + "in_proj_qkvz.weight")[qkvz_order.to(self.device)]
            ba = get(a + "in_proj_ba.weight")[ba_order.to(self.device)]
            mixer = GatedDeltaNetWeights(
                w_in=weights.cat([qkvz, ba]),
                conv_w=get(a + "conv1d.weight", f32).squeeze(1).contiguous(),
                A_log=get(a + "A_log", f32), dt_bias=get(a + "dt_bias", f32),
                norm_w=get(a + "norm.weight", f32), w_out=get(a + "out_proj.weight"))
        else:
            a = p + "self_attn."
            q = get(a + "q_proj.weight")[qg_order.to(self.device)]
            b_qkv = b_o = None
            if c.attention_bias:
                qb = get(a + "q_proj.bias", f32)[qg_order.to(self.device)]
                b_qkv = torch.cat([qb, get(a + "k_proj.bias", f32), get(a + "v_proj.bias", f32)])
                b_o = get(a + "o_proj.bias", f32)
            mixer = GatedAttentionWeights(
                w_qkv=weights.cat([q, get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
                b_qkv=b_qkv, q_norm=get(a + "q_norm.weight", f32), k_norm=get(a + "k_norm.weight", f32),
                w_o=get(a + "o_proj.weight"), b_o=b_o)
        m = p + "mlp."
        if c.sparse(i):
            router_w = get(m + "gate.weight")
            shared = {}
            if c.shared_intermediate_size:   # read first, so float experts can stack it in place (moe_weights)
                router_w = weights.cat([router_w, get(m + "shared_expert_gate.weight")])
                shared = dict(shared_gate_up=weights.cat([get(m + "shared_expert.gate_proj.weight"),
                                                          get(m + "shared_expert.up_proj.weight")]),
                              shared_down=get(m + "shared_expert.down_proj.weight"), shared_gated=True)
            mlp = moe_weights(get, m + "experts", c.num_experts, router=router_w, **shared)
        else:
            mlp = DenseMLP(weights.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                           get(m + "down_proj.weight"))
        return Layer(mixer, mlp)

    # -- state -------------------------------------------------------------------------------
    def state_specs(self) -> Dict[str, StateSpec]:
        c, f32 = self.cfg, torch.float32
        s = {}
        for i in range(c.num_layers + (self.mtp is not None)):
            if c.kind(i) == "linear_attention":
                s[f"layers.{i}.conv"] = StateSpec((c.conv_dim, c.conv_kernel - 1), f32)
                s[f"layers.{i}.recurrent"] = StateSpec((c.lin_v_heads, c.lin_k_dim, c.lin_v_dim), f32,
                                                       order=gdn.STATE_ORDER)
            else:
                s[f"layers.{i}.k"] = StateSpec((CTX, c.num_kv_heads, c.head_dim), self.dtype)
                s[f"layers.{i}.v"] = StateSpec((CTX, c.num_kv_heads, c.head_dim), self.dtype)
        return s


    def rollback(self, slot: int, consumed: int) -> None:
        """Keep the first ``consumed`` tokens of the slot's last verify chunk (a segment run with
        ``keep``): each Gated DeltaNet layer's recurrent state becomes the one the kernel stored after
        token ``consumed - 1``, and its conv history the last W-1 inputs of the history before the
        chunk followed by the chunk's first ``consumed`` inputs. No recomputation: the bits are those
        the chunk produced, which equal token-by-token decoding (prefill chunk invariance)."""
        W1 = self.cfg.conv_kernel - 1
        for (i, s) in [key for key in self._kept if key[1] == slot]:
            hist, inputs, states = self._kept.pop((i, s))
            if not 1 <= consumed <= inputs.shape[0]:
                raise ValueError(f"rollback: consumed {consumed} outside [1, {inputs.shape[0]}]")
            self.pool.tensors[f"layers.{i}.recurrent"][slot].copy_(states[consumed - 1])
            seq = torch.cat([hist, inputs[:consumed].t()], dim=1)
            self.pool.tensors[f"layers.{i}.conv"][slot].copy_(seq[:, seq.shape[1] - W1:])

    # -- compute -----------------------------------------------------------------------------
    def mixer(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        if self.cfg.kind(i) == "linear_attention":
            return self._gated_deltanet(i, x, batch)
        return self._gated_attention(i, x, batch)

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        return ffn(self.layers[i].ffn, x, self.router_cfg)

    def _gated_attention(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        c, w = self.cfg, self.layers[i].mixer
        R, H, KV, hd = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = fused_linear(x, w.w_qkv, w.b_qkv)
        # Views of the projection (the prologue kernel takes any strides).
        q = qkv[:, : H * hd].unflatten(1, (H, hd))
        gate = qkv[:, H * hd: 2 * H * hd]
        k = qkv[:, 2 * H * hd: 2 * H * hd + KV * hd].unflatten(1, (KV, hd))
        v = qkv[:, 2 * H * hd + KV * hd:].unflatten(1, (KV, hd))
        kc, vc = self.pool.tensors[f"layers.{i}.k"], self.pool.tensors[f"layers.{i}.v"]
        # q/k norms (zero-centred), RoPE, and k/v into the cache: one launch.
        q = ops.norm_rope_write_kv(q, k, v, w.q_norm, w.k_norm, c.eps, batch.positions, self.inv_freq,
                                         kc, vc, batch.slots, rotary_dim=c.rotary_dim, zero_centered=True)
        # · sigmoid(gate), stored in the dtype o_proj rounds its input to
        o = ops.decode_attention(q, kc, vc, batch.slots, batch.lengths, hd ** -0.5, gate=gate,
                                 same_slot_runs=runs_hint(batch), **narrow_store(qkv, w.w_o),
                                 **products_kwargs(self.attention_products))
        return Projection(o.view(R, H * hd), w.w_o, w.b_o)

    def _gated_deltanet(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        c, w = self.cfg, self.layers[i].mixer
        R, hk, hv, dk, dv = x.shape[0], c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim
        cd = c.conv_dim
        conv_state = self.pool.tensors[f"layers.{i}.conv"]
        if batch.all_single:
            # the projection and the conv of its q | k | v columns in one op (the split-K sum inside the conv)
            mixed, proj = ops.linear_conv1d_update(x, w.w_in, conv_state, w.conv_w, batch.slots)
        else:
            proj = fused_linear(x, w.w_in)
            mixed = proj[:, :cd]
        # Views, never .contiguous(): see docs/kernel-conventions.md ("one row vs many").
        z = proj[:, cd: cd + hv * dv]
        b = proj[:, cd + hv * dv: cd + hv * dv + hv]
        a = proj[:, cd + hv * dv + hv:]
        rec = self.pool.tensors[f"layers.{i}.recurrent"]

        def split(m):
            n = m.shape[0]
            q = m[:, : hk * dk].reshape(n, hk, dk)
            k = m[:, hk * dk: 2 * hk * dk].reshape(n, hk, dk)
            v = m[:, 2 * hk * dk:].reshape(n, hv, dv)
            return q, k, v

        if batch.all_single:
            q, k, v = split(mixed)
            # The output norm comes with the step (bitwise as the gated_rms_norm below).
            y = ops.gdn_decode(q, k, v, a, b, w.A_log, w.dt_bias, rec, batch.slots,
                               z=z.unflatten(1, (hv, dv)), norm_w=w.norm_w, norm_eps=c.eps,
                               **narrow_store(proj, w.w_out))
            return Projection(y.view(R, hv * dv), w.w_out)
        o = torch.empty((R, hv, dv), dtype=torch.float32, device=x.device)
        if batch.single_rows.numel():
            idx = batch.single_rows  # on the device already: no host sync
            m1 = ops.conv1d_update(mixed[idx], conv_state, w.conv_w, batch.slots[idx])
            q, k, v = split(m1)
            o[idx] = ops.gdn_decode(q, k, v, a[idx], b[idx], w.A_log, w.dt_bias, rec, batch.slots[idx])
        if batch.multi_segments is not None:
            # Every multi-token segment (a prefill chunk or a verify chunk per session) in one conv and
            # one recurrence launch: a program per segment, each exactly the one-session prefill.
            # A verify chunk keeps what a rollback to any prefix of it needs; the kept states of every
            # such chunk share one buffer of their rows only (Segment.states_row), not one of all R rows.
            keeps = [s for s in batch.segments if s.states_row >= 0]
            # in the pool's per-slot layout (the kernel checks it)
            spec = self.pool.specs[f"layers.{i}.recurrent"]
            states = spec.allocate(sum(s.n for s in keeps), 0, x.device, zeroed=False) if keeps else None
            for s in keeps:
                rows = slice(s.start_row, s.start_row + s.n)
                self._kept[(i, s.slot)] = (conv_state[s.slot].clone(), mixed[rows].float().clone(),
                                           states[s.states_row:s.states_row + s.n])
            m1 = ops.conv1d_prefill_segments(mixed, conv_state, w.conv_w, batch.multi_segments,
                                             max_rows=max(s.n for s in batch.segments))
            q, k, v = split(m1)
            ops.gdn_prefill_segments(q, k, v, a, b, w.A_log, w.dt_bias, rec, batch.multi_segments, out=o,
                                     states_out=states)
        y = ops.gated_rms_norm(o.reshape(R * hv, dv), z.unflatten(1, (hv, dv)), w.norm_w, c.eps,
                               **narrow_store(proj, w.w_out))
        return Projection(y.view(R, hv * dv), w.w_out)


def preset_config(name: str) -> dict:
    """HF-style config dicts for the built-in Qwen3-Next presets."""
    if name == "tiny-qwen":
        return dict(
            # Two layers (one of each mixer) keep the CPU demo fast in the Triton interpreter.
            model_type="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False, mtp_num_hidden_layers=1)
    if name == "qwen3-next-80b-4l":
        # Qwen3-Next-80B-A3B layer dimensions, 4 layers (3 Gated DeltaNet + 1 gated attention).
        return dict(
            model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
            max_position_embeddings=262144, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False, mtp_num_hidden_layers=1)
    if name == "qwen3-next-80b":
        # Qwen3-Next-80B-A3B at full depth in bf16 (~160 GB): more than one H200 holds; for tensor parallel
        # (ds4t.load("qwen3-next-80b", tp=2): ~80 GB per GPU).
        cfg = preset_config("qwen3-next-80b-4l")
        cfg.update(num_hidden_layers=48, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12)
        return cfg
    if name == "qwen3-next-80b-fp8":
        # Qwen3-Next-80B-A3B at full depth (48 layers: 12 x [3 Gated DeltaNet + 1 gated attention]) in
        # block-FP8 as the official -FP8 release stores it: random weights drawn on the device and
        # quantized as they are read (~80 GB; one H200 holds it, bf16's 160 GB would not fit).
        cfg = preset_config("qwen3-next-80b-4l")
        cfg.update(num_hidden_layers=48, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
                   quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]})
        return cfg
    raise KeyError(name)


def preset_init(name: str, shape, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Random weights that keep activations O(1) through the stack."""
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(0.0, 2.5, generator=g)
    if name.endswith("dt_bias"):
        return torch.empty(shape, device=device).uniform_(-1.0, 1.0, generator=g)
    if name.endswith("linear_attn.norm.weight"):  # the one plain (not zero-centred) norm
        return 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
    if len(shape) == 1:  # zero-centred norm weights: gain 1 + w
        return 0.1 * torch.randn(shape, generator=g, device=device)
    fan_in = shape[-1]
    return torch.randn(shape, generator=g, device=device) * (fan_in ** -0.5)
