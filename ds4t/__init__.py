"""ds4t: session batching of LLM decode with batch-invariant Triton kernels.

    model = ds4t.load("tiny-qwen")            # or an HF checkpoint directory
    s = model.new_session(max_ctx=4096)
    logits = s.prefill([1, 2, 3])             # float32 [vocab]
    res = ds4t.eval_batch([ds4t.DecodeItem(s, 7), ...], mode="auto")
    out = ds4t.generate(model, ["hello", [1, 2, 3]], max_new_tokens=8, temperature=0.8, seed=0)
    ds4t.sampling.sample(logits[None], temperature=0.8, seed=0, position=3)  # token ids int64 [1]

Importing ds4t selects the kernel backend (CUDA Triton with a GPU, the Triton interpreter on
the CPU otherwise); see :mod:`ds4t.backend`.
"""
from ds4t import backend  # noqa: F401  (must run before anything imports triton)
from ds4t.batch.engine import BatchResult, DecodeItem, eval_batch
from ds4t.batch.errors import BatchError, NotNativeError
from ds4t.batch.session import Session
from ds4t import sampling
from ds4t.generation import Generation, generate
from ds4t.models.checkpoint import CheckpointError
from ds4t.models.registry import load, presets

__version__ = "0.1.0"
__all__ = ["load", "presets", "Session", "DecodeItem", "eval_batch", "BatchResult", "BatchError",
           "NotNativeError", "CheckpointError", "generate", "Generation", "sampling"]
