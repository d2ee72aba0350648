"""ds4t: session batching of LLM decode with batch-invariant Triton kernels.

Importing ds4t selects the kernel backend (CUDA Triton with a GPU, the Triton interpreter on
the CPU otherwise); see :mod:`ds4t.backend`.
"""
from ds4t import backend  # noqa: F401  (must run before anything imports triton)

__version__ = "0.1.0"
