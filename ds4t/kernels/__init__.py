"""Triton kernels, each beside its plain-torch reference.

One module per op family. Every module exposes launchers (``name(...)``) and references
(``name_ref(...)``) with the same signature, and registers a self-check with
:func:`ds4t.kernels.registry.register_check` that ``ds4t check`` runs.
"""
