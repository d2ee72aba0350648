"""bench/ncu_target.py: the weights it builds for Nsight Compute, and its refusal without a GPU."""
import pytest
import torch

from ds4t.kernels.quant_blocks import GGUFWeight
from ds4t.kernels.weights import FP8Weight
from tests.bench_scripts import load

nt = load("bench/ncu_target.py", "bench_ncu_target")


@pytest.mark.parametrize("kind,cls", [("bf16", torch.Tensor), ("fp8", FP8Weight), ("q8_0", GGUFWeight),
                                      ("q4_k", GGUFWeight), ("q6_k", GGUFWeight)])
def test_weights_of_every_kind(kind, cls):
    w = nt.make_weight((2, 32, 256), kind, torch.Generator().manual_seed(0), "cpu")
    assert isinstance(w, cls) and tuple(w.shape) == (2, 32, 256)
    if kind != "bf16":
        assert w.act_dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        nt.main(["linear", "--weights", "q4_k"])


def test_mla_target_runs_a_forced_tile():
    """``ncu_target.py mla``: DeepSeek-V3's MLA decode at a given context, a tile forced by --tile (here in the
    interpreter, or on the GPU where there is one: Triton runs CPU tensors only in the interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = nt._mla_run(1, 32, "64x32x8x2", torch.Generator(device).manual_seed(0), device)
    run()
