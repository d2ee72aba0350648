"""The interpreter's twins of GPU kernels (the ``"interp"`` variant of their ops).

Where a GPU kernel's grid costs the Triton interpreter many programs (one per row, per expert,
per KV split), its twin here does the same arithmetic, in the same order, in one program per block
of rows. The GPU kernels stay as they are; the tests run both in the interpreter
(:func:`ds4t.kernels.registry.use_variants`) and compare them bitwise where the module says so.
"""
