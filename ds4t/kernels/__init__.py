"""Triton kernels, each beside its plain-torch reference, and the registry the models call them through.

One module per op family. Every module exposes launchers (``name(...)``) and references
(``name_ref(...)``) with the same signature, registers its launchers as ops
(:func:`ds4t.kernels.registry.register_op`) and a self-check that ``ds4t check`` runs
(:func:`ds4t.kernels.registry.register_check`). Models call ``ops.<name>(...)``;
``override(name, fn)`` swaps an op in every model.
"""
from ds4t.kernels.registry import (Override, op, op_names, ops, override, overrides, recording, use_variants,
                                   variant)

__all__ = ["Override", "op", "op_names", "ops", "override", "overrides", "recording", "use_variants", "variant"]
