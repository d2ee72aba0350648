"""The kernel registry: ops, overrides, variants, recording."""
import pytest
import torch

import ds4t
from ds4t.backend import INTERPRET
from ds4t.kernels import linear as L
from ds4t.kernels import norm as NM
from ds4t.kernels import router as RT
from ds4t.kernels import registry
from ds4t.kernels.registry import GPU, INTERP, UnknownOpError, op, op_names, ops, override, recording, use_variants


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


def _logits(model, prompt=(3, 1, 4, 1, 5)):
    s = model.new_session(16)
    try:
        return s.prefill(list(prompt))
    finally:
        s.close()


def test_every_model_op_is_registered():
    for name in ("linear", "linear_heads", "rms_norm", "add_rms_norm", "gated_rms_norm", "rope", "decode_attention",
                 "norm_rope_write_kv", "write_kv", "mla_decode", "write_latent", "gdn_decode", "gdn_prefill",
                 "conv1d_update", "conv1d_prefill", "moe_experts", "router_softmax_topk", "router_sigmoid_grouped",
                 "embedding", "silu_mul", "sigmoid_mul", "add", "sample", "argmax"):
        o = op(name)
        assert o.fn.__name__ == name and (o.reference is None or o.reference.__name__ == name + "_ref")


def test_unknown_op_lists_the_known_ones():
    with pytest.raises(UnknownOpError,
                       match="unknown op 'linaer'; known ops: .*linear, linear_add_rms_norm, linear_conv1d_update, linear_heads"):
        override("linaer", lambda *a, **k: None)
    with pytest.raises(AttributeError, match="known ops"):
        ops.linaer


def test_override_swaps_the_op_in_every_model_and_restores(model):
    before = _logits(model)
    seen = []

    def shifted(x, weight, bias=None, *, out=None):
        seen.append(tuple(x.shape))
        y = L.linear(x, weight, bias, out=out)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    with override("linear", shifted) as h:
        assert registry.dispatch_modified() and registry.overrides() == {"linear": registry.describe(shifted)}
        assert op("linear").label() == f"linear (overridden by {__name__}.test_override_swaps_the_op_in_every_model_" \
                                       "and_restores.<locals>.shifted)"
        during = _logits(model)
    assert seen and not h.active and not registry.dispatch_modified()
    assert not torch.equal(during, before)          # the override ran (it moves every output by an ulp)
    assert torch.equal(_logits(model), before)      # and is gone


def test_override_without_a_block_and_nested():
    first = override("rms_norm", lambda *a, **k: "outer")
    try:
        with override("rms_norm", lambda *a, **k: "inner"):
            assert ops.rms_norm(None, None, 0.0) == "inner"
        assert ops.rms_norm(None, None, 0.0) == "outer"
    finally:
        first.restore()
    assert op("rms_norm").impl is op("rms_norm").fn


def test_override_with_a_wrong_signature_fails_at_call_time(model):
    def one_arg(x):
        return x

    with override("linear", one_arg):
        with pytest.raises(TypeError, match=r"override of op 'linear' by .*one_arg\(x\) cannot take the call "
                                            r"linear\(<Tensor>, <Tensor>, <NoneType>\): too many positional arguments\. "
                                            r"The op's signature is linear\(x"):
            _logits(model)
    with pytest.raises(TypeError, match="expected a function"):
        override("linear", 3)


def test_an_override_may_ignore_advisory_keywords():
    """A norm override written against the fp32 signature (no ``out_dtype``) still runs in a bf16 model,
    whose norms ask for bf16 outputs where every reader rounds to bf16 anyway: the registry drops the
    advisory keyword for it, and the logits are those of the stock kernels (their readers round the
    override's fp32 output to the same bf16 values; bit for bit in the interpreter). A keyword that is not
    advisory still fails."""
    bf16 = ds4t.load("tiny-qwen", dtype=torch.bfloat16)
    assert "out_dtype" in registry.ADVISORY_KWARGS
    seen = []

    def fp32_norm(x, residual, weight, eps, *, zero_centered=False):
        seen.append(x.shape)
        return NM.add_rms_norm(x, residual, weight, eps, zero_centered=zero_centered)

    before = _logits(bf16)
    with override("add_rms_norm", fp32_norm):
        during = _logits(bf16)
    assert seen
    if INTERPRET:
        assert torch.equal(during, before)
    else:   # the compiled bf16-output norm may round its statistics differently (ds4t.kernels.norm)
        assert ((during - before).abs().max() / before.abs().max()).item() < 2e-2
    with override("add_rms_norm", fp32_norm):
        with pytest.raises(TypeError, match="cannot take the call"):
            ops.add_rms_norm(torch.ones(1, 4), torch.ones(1, 4), torch.ones(4), 1e-6, unknown=1)


def test_a_silu_mul_override_without_out_dtype_runs_in_a_bf16_model():
    """swiglu asks silu_mul for a bf16 store (its down projection rounds to bf16 anyway); an override
    written against the fp32 signature gets the call without the advisory keyword and the same logits."""
    from ds4t.kernels import activation

    bf16 = ds4t.load("tiny-deepseek", dtype=torch.bfloat16)
    seen = []

    def fp32_silu_mul(gate, up):
        seen.append(gate.shape)
        return activation.silu_mul(gate, up)

    before = _logits(bf16)
    with override("silu_mul", fp32_silu_mul):
        during = _logits(bf16)
    assert seen and torch.equal(during, before)


def test_use_variants_checks_names_and_restores():
    default = registry.variant("linear")
    with use_variants({"linear": GPU}):
        assert registry.variant("linear") == GPU and registry.dispatch_modified()
    assert registry.variant("linear") == default
    with pytest.raises(ValueError, match="op 'rms_norm' has no variant 'gpu'"):
        with use_variants({"rms_norm": GPU}):
            pass
    with pytest.raises(ValueError, match=r"has no variant 'fast'; it has \['gpu', 'interp'\]"):
        with use_variants({"linear": "fast"}):
            pass


def test_variants_give_the_same_bits(model):
    """Every op's GPU launches and its interpreter twin agree on a whole model step (in the
    interpreter both run); a negative control shows the comparison sees a changed op."""
    if not registry.INTERPRET:
        pytest.skip("the interpreter twins run only in the interpreter")
    twins = _logits(model)
    with use_variants({o.name: GPU for o in registry.ops_with_variants()}):
        assert registry.variant("moe_experts") == GPU
        gpu = _logits(model)
    assert torch.equal(twins, gpu)
    with override("rms_norm", lambda x, w, eps, **k: NM.rms_norm(x, w, eps * 2, **k)):
        assert not torch.equal(_logits(model), twins)


def test_recording_logs_every_op_call_with_its_label(model):
    with override("router_softmax_topk", RT.router_softmax_topk):
        with recording() as log:
            _logits(model, (1, 2))
    names = {c.name for c in log}
    assert {"embedding", "linear", "rms_norm", "moe_add_rms_norm", "router_softmax_topk"} <= names
    assert all(c.overridden == (c.name == "router_softmax_topk") for c in log)
    assert all(c.label == c.name for c in log if not c.overridden)
    assert op_names() == sorted(op_names())
