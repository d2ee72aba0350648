"""RoPE: reference (both pair layouts, partial rotary, YaRN scale), HF parity, q·k under the
interleaved permutation, in-place use, batch invariance."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.kernels.rope import default_inv_freq, rope, rope_ref
from tests.kernels.devices import gen
from tests.kernels.invariance import assert_rows_invariant, poisoned

pytestmark = pytest.mark.usefixtures("on_kernel_device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 math on exactly representable inputs: only cos/sin (numpy vs torch, 1 ulp) and the
# order of one multiply-add differ. Inputs are O(1), angles up to ~5e5 rad.
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2e-6, 1e-5), torch.float16: (2e-6, 1e-5)}


def _gen(seed):
    return gen(seed)


def _run(x, pos, inv, **kw):
    out = poisoned(x.shape, device=x.device)
    res = rope(x, pos, inv, out=out, **kw)
    assert res is out
    return res


# (H, D, R): partial rotary with non-power-of-two halves, full rotary, no pass-through
SHAPES = [(3, 80, 40), (5, 48, 48), (2, 20, 12), (4, 64, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H%d-D%d-R%d" % s)
def test_matches_reference(device, dtype, interleaved, shape):
    H, D, R = shape
    g = _gen(1)
    x = torch.randn(6, H, D, generator=g).to(dtype).to(device)
    pos = torch.tensor([0, 1, 17, 4095, 131071, 500000], dtype=torch.int64, device=device)
    inv = default_inv_freq(R, 1e6 if R > 16 else 10000.0, device=device)
    for scale in (1.0, 1.2):
        got = _run(x, pos, inv, interleaved=interleaved, scale=scale)
        ref = rope_ref(x, pos, inv, interleaved=interleaved, scale=scale)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        assert torch.equal(got[..., R:], x[..., R:].float())      # pass-through is exact


def test_rotary_dim_argument_and_int32_positions(device):
    g = _gen(2)
    x = torch.randn(3, 2, 24, generator=g).to(device)
    pos = torch.tensor([5, 0, 9], dtype=torch.int32, device=device)
    inv = default_inv_freq(8, 10000.0, device=device)
    got = _run(x, pos, inv, rotary_dim=8)
    torch.testing.assert_close(got, rope_ref(x, pos.long(), inv), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError):
        rope(x, pos, inv, rotary_dim=10)
    with pytest.raises(ValueError):
        rope(x, pos, default_inv_freq(26, 10000.0))


def test_strided_input_and_in_place(device):
    """q as a view of a [q ‖ gate] projection (Qwen3-Next), then in place on an fp32 buffer."""
    g = _gen(3)
    qg = torch.randn(4, 3, 2 * 32, generator=g).to(device)
    q = qg[..., :32]
    pos = torch.tensor([3, 100, 7, 0], device=device)
    inv = default_inv_freq(8, 10000.0, device=device)
    ref = rope_ref(q, pos, inv)
    torch.testing.assert_close(_run(q, pos, inv), ref, atol=2e-6, rtol=1e-5)
    for inter in (False, True):
        buf = q.contiguous()
        res = rope(buf, pos, inv, interleaved=inter, out=buf)
        assert res is buf
        torch.testing.assert_close(buf, rope_ref(q, pos, inv, interleaved=inter), atol=2e-6, rtol=1e-5)


def _deinterleave_perm(R, D):
    """HF's de-interleaving of the rotary dims: evens then odds; pass-through dims stay."""
    return torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2), torch.arange(R, D)])


def test_interleaved_equals_hf_permuted_layout_and_same_qk(device):
    """HF (DeepSeek rope_interleave) = de-interleave with P, then rotate-half. Ours rotates the
    pairs in place: hf = ours[..., P], so q·k is the same."""
    g = _gen(4)
    H, D, R = 3, 40, 24
    q = torch.randn(5, H, D, generator=g).to(device)
    k = torch.randn(5, H, D, generator=g).to(device)
    qpos = torch.tensor([9, 10, 11, 300, 70000], device=device)
    kpos = torch.tensor([0, 4, 11, 299, 12], device=device)
    inv = default_inv_freq(R, 10000.0, device=device)
    P = _deinterleave_perm(R, D).to(device)
    ours_q = _run(q, qpos, inv, interleaved=True, scale=1.3)
    ours_k = _run(k, kpos, inv, interleaved=True, scale=1.3)
    hf_q = rope_ref(q[..., P], qpos, inv, scale=1.3)
    hf_k = rope_ref(k[..., P], kpos, inv, scale=1.3)
    torch.testing.assert_close(ours_q[..., P], hf_q, atol=2e-6, rtol=1e-5)
    qk_ours = (ours_q * ours_k).sum(-1)
    qk_hf = (hf_q * hf_k).sum(-1)
    torch.testing.assert_close(qk_ours, qk_hf, atol=1e-5, rtol=1e-5)
    # and the rotation really changed q·k (positions differ)
    assert not torch.allclose(qk_ours, (q * k).sum(-1) * 1.69, atol=1e-3)


def test_matches_hf_transformers(device):
    """Against HF's own rotary embeddings: GLM-4.5 (partial rotate-half) and DeepSeek-V3
    (interleaved, YaRN inv_freq and attention scaling)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    g = _gen(5)
    pos = torch.tensor([[0, 3, 77, 1000, 4093]])
    # GLM: head_dim 16, partial_rotary_factor 0.5 -> R = 8
    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=4096,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    emb = glm.Glm4MoeRotaryEmbedding(cfg)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k = torch.randn(1, 2, 5, 16, generator=g)
    cos, sin = emb(q, pos)
    hq, hk = glm.apply_rotary_pos_emb(q, k, cos, sin)
    inv = emb.inv_freq.float()
    assert torch.equal(inv, default_inv_freq(8, 10000.0))
    x = q[0].transpose(0, 1).contiguous().to(device)                 # [T, H, D] rows
    got = _run(x, pos[0].to(device), inv.to(device), scale=emb.attention_scaling)
    torch.testing.assert_close(got.cpu(), hq[0].transpose(0, 1).cpu(), atol=2e-6, rtol=1e-5)
    got_k = _run(k[0].transpose(0, 1).contiguous().to(device), pos[0].to(device), inv.to(device))
    torch.testing.assert_close(got_k.cpu(), hk[0].transpose(0, 1).cpu(), atol=2e-6, rtol=1e-5)

    # DeepSeek-V3: YaRN, interleaved pairs, qk_rope_head_dim 8
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
                           rope_interleave=True, max_position_embeddings=16384,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 4096,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                            "mscale_all_dim": 0.0})
    emb = ds.DeepseekV3RotaryEmbedding(cfg)
    assert emb.attention_scaling != 1.0
    pos = torch.tensor([[0, 5, 4096, 9000, 16000]])
    q = torch.randn(1, 4, 5, 8, generator=g)
    k = torch.randn(1, 1, 5, 8, generator=g)
    cos, sin = emb(q, pos)
    hq, hk = ds.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    P = _deinterleave_perm(8, 8)
    got = _run(q[0].transpose(0, 1).contiguous().to(device), pos[0].to(device), emb.inv_freq.float().to(device),
               interleaved=True, scale=emb.attention_scaling)
    torch.testing.assert_close(got[..., P].cpu(), hq[0].transpose(0, 1).cpu(), atol=2e-6, rtol=1e-5)


def test_default_inv_freq():
    inv = default_inv_freq(6, 10000.0)
    assert inv.dtype == torch.float32 and inv.shape == (3,)
    ref = 1.0 / (10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float32) / 6))
    assert torch.equal(inv, ref)


_POOL = 33


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_rows_batch_invariant(data):
    g = _gen(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    x = torch.randn(_POOL, 3, 20, generator=g).bfloat16()
    pos = torch.randint(0, 200000, (_POOL,), generator=g)
    inv = default_inv_freq(12, 10000.0)
    inter = data.draw(st.booleans(), label="interleaved")
    B = data.draw(st.integers(1, _POOL), label="B")
    rows = data.draw(st.permutations(range(_POOL)), label="order")[:B]
    i = data.draw(st.integers(0, B - 1), label="i")

    def run(r):
        idx = torch.tensor(r, dtype=torch.long)
        return _run(x[idx], pos[idx], inv, interleaved=inter, scale=1.1)

    assert_rows_invariant(run, rows, i)
