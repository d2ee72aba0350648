"""The kernel registry: every op the models call, the self-checks ``ds4t check`` runs, overrides.

Ops
    Each kernel module registers its launchers with :func:`register_op` (name = the launcher's
    name, e.g. ``"linear"``, with its plain-torch reference). Models call them through
    :data:`ops` (``ops.linear(x, w)``), never through module attributes, so one
    :func:`override` swaps an op in every model::

        with ds4t.kernels.override("linear", my_linear):   # or keep the handle and .restore()
            model.new_session(64).prefill([1, 2, 3])

    While an override is active, CUDA graphs are bypassed (a captured step would replay the
    kernels it was captured with; ``ds4t.batch.graphs.enabled_for`` asks :func:`dispatch_modified`),
    unless the caller opts in with ``ds4t.batch.graphs.capture_overrides()`` (graph-safe overriding
    functions only: graphs are then keyed by :func:`override_key`).

Variants
    Some launchers implement more than one launch variant with the same arithmetic: ``"gpu"``
    (what runs on a GPU) and ``"interp"`` (the interpreter's twin: fewer, bigger programs; see
    ``ds4t/kernels/interp/``), and MoE's ``"host_list"``. The backend picks the default
    (``"interp"`` where an op has one and Triton runs in the interpreter, else ``"gpu"``);
    :func:`use_variants` selects others for a block (the tests run both in the interpreter).

Recording
    :func:`recording` logs every op call made through :data:`ops` (name, implementation, outputs):
    what :mod:`ds4t.exactness.diagnose` compares row by row.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ds4t.backend import INTERPRET

# ----------------------------------------------------------------------------------------------
# Self-checks (``ds4t check``)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckResult:
    kernel: str          # e.g. "linear bf16"
    shapes: str          # e.g. "B=5 K=96 N=200"
    max_err: float       # max |kernel - reference| (relative where stated in ``note``)
    tol: float           # the tolerance max_err was held to
    batch_invariant: bool  # row i alone == row i among the batch, bitwise
    ms: float            # median kernel time in milliseconds on this device
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol and self.batch_invariant


_CHECKS: List[Callable[[torch.device], List[CheckResult]]] = []


def register_check(fn: Callable[[torch.device], List[CheckResult]]):
    """Register ``fn(device) -> [CheckResult]``; used as a decorator in each kernel module."""
    _CHECKS.append(fn)
    return fn


_NOT_KERNEL_MODULES = ("registry", "config", "tensors", "interp")


def import_kernel_modules() -> None:
    """Import every kernel module of ds4t.kernels (each registers its ops and self-check)."""
    import ds4t.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in _NOT_KERNEL_MODULES:
            importlib.import_module(f"ds4t.kernels.{info.name}")


def all_checks() -> List[Callable[[torch.device], List[CheckResult]]]:
    import_kernel_modules()
    return list(_CHECKS)


def rows_invariant(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """True when ``run`` on all rows of x gives, for each row, the bits it gives on that row alone.

    ``run`` maps a batch [B, ...] to outputs [B, ...]; rows are compared with torch.equal.
    """
    full = run(x)
    for i in range(x.shape[0]):
        alone = run(x[i : i + 1].contiguous())
        if not torch.equal(alone[0], full[i]):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------------------------
GPU = "gpu"              # what runs on a GPU
INTERP = "interp"        # the interpreter's twin (ds4t/kernels/interp/)
HOST_LIST = "host_list"  # MoE: the grouped kernels over a host-made list of the chosen experts


def describe(fn: Callable) -> str:
    """``module.qualname`` of a function (how overrides are named in errors and reports)."""
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}"


@dataclasses.dataclass
class Op:
    """One registered op: the ds4t launcher, its reference and its launch variants."""
    name: str
    fn: Callable                        # the ds4t launcher
    reference: Optional[Callable]       # the plain-torch reference (same signature)
    family: str                         # the kernel module, e.g. "linear"
    variants: Tuple[str, ...] = ()      # launch variants the launcher implements
    overrides: List[Tuple[object, Callable]] = dataclasses.field(default_factory=list)  # (token, fn), last wins

    @property
    def impl(self) -> Callable:
        """What a call runs now: the innermost override, else the ds4t launcher."""
        return self.overrides[-1][1] if self.overrides else self.fn

    @property
    def overridden(self) -> bool:
        return bool(self.overrides)

    def label(self) -> str:
        """``"linear"``, or ``"linear (overridden by mymodule.my_linear)"``."""
        return f"{self.name} (overridden by {describe(self.impl)})" if self.overrides else self.name

    def default_variant(self) -> Optional[str]:
        if not self.variants:
            return None
        return INTERP if INTERPRET and INTERP in self.variants else self.variants[0]


class UnknownOpError(KeyError):
    """An op name the registry does not know; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


_OPS: Dict[str, Op] = {}
_modules_imported = False


def register_op(fn: Callable, *, reference: Optional[Callable] = None, name: Optional[str] = None,
                variants: Sequence[str] = ()) -> Callable:
    """Register launcher ``fn`` as op ``name`` (default ``fn.__name__``); returns ``fn``.

    ``variants``: the launch variants ``fn`` implements, the GPU's first (it reads the selected one
    with :func:`variant`)."""
    name = name or fn.__name__
    if name in _OPS and _OPS[name].fn is not fn:
        raise ValueError(f"op {name!r} is registered twice ({describe(_OPS[name].fn)} and {describe(fn)})")
    family = (getattr(fn, "__module__", "") or "").rsplit(".", 1)[-1]
    _OPS[name] = Op(name, fn, reference, family, tuple(variants))
    return fn


def _all_ops() -> Dict[str, Op]:
    global _modules_imported
    if not _modules_imported:
        import_kernel_modules()
        _modules_imported = True
    return _OPS


def op_names() -> List[str]:
    """Names of every registered op, sorted."""
    return sorted(_all_ops())


def op(name: str) -> Op:
    """The registered op ``name``; an unknown name raises :class:`UnknownOpError` (a KeyError)
    listing the known ones."""
    ops_ = _all_ops()
    try:
        return ops_[name]
    except KeyError:
        raise UnknownOpError(f"unknown op {name!r}; known ops: {', '.join(sorted(ops_))}") from None


# ----------------------------------------------------------------------------------------------
# Overrides
# ----------------------------------------------------------------------------------------------
_ACTIVE_OVERRIDES: set = set()
"""Every active :class:`Override`: :func:`dispatch_modified` runs before each decode step's graph replay, where
a scan of every op's stack cost ~3 us of an N = 1 step's host path."""


class Override:
    """An active override of one op (see :func:`override`): a context manager, or ``.restore()``."""

    def __init__(self, op_: Op, fn: Callable):
        self.op = op_
        self.fn = fn
        self.active = True
        op_.overrides.append((self, fn))
        _ACTIVE_OVERRIDES.add(self)

    def restore(self) -> None:
        """Undo this override (other overrides of the op, inner or outer, stay)."""
        if self.active:
            self.op.overrides[:] = [(t, f) for t, f in self.op.overrides if t is not self]
            self.active = False
            _ACTIVE_OVERRIDES.discard(self)

    def __enter__(self) -> "Override":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "restored"
        return f"<ds4t override of {self.op.name!r} by {describe(self.fn)} ({state})>"


def override(name: str, fn: Callable) -> Override:
    """Make every call of op ``name`` through :data:`ops` (every model) run ``fn`` instead.

    Takes effect at once and lasts until the returned handle's ``.restore()``, or the end of a
    ``with`` block when used as one: ``with override("linear", my_linear): ...``. Registered at
    import time of a module, it holds for the process (``ds4t --import mymodule``). ``fn`` gets
    the arguments the models pass to the ds4t launcher (see ``op(name).fn`` for its signature);
    a call it cannot accept raises a TypeError naming the op, ``fn`` and that signature. Nested
    overrides stack; the innermost wins. CUDA graphs are bypassed while any override is active.
    """
    if not callable(fn):
        raise TypeError(f"override({name!r}, ...): expected a function, got {type(fn).__name__}")
    return Override(op(name), fn)


def overrides() -> Dict[str, str]:
    """The ops overridden now: name -> the function that runs (``module.qualname``)."""
    return {n: describe(o.impl) for n, o in _OPS.items() if o.overrides}


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------
_VARIANTS: Dict[str, str] = {}   # op name -> selected variant (absent: the backend's default)


def variant(name: str) -> Optional[str]:
    """The launch variant op ``name`` runs now (None for an op without variants)."""
    sel = _VARIANTS.get(name)
    if sel is not None:
        return sel
    o = _OPS.get(name)
    return (o if o is not None else op(name)).default_variant()


@contextlib.contextmanager
def use_variants(selection: Dict[str, str]) -> Iterator[None]:
    """Run ops with the given launch variants inside the block: ``{"moe_experts": "gpu"}``.

    An op or variant that does not exist raises ValueError; on a GPU only GPU-capable variants
    make sense (``"interp"`` runs, slowly, only where the launcher honours it)."""
    for n, v in selection.items():
        o = op(n)
        if v not in o.variants:
            raise ValueError(f"op {n!r} has no variant {v!r}; it has {list(o.variants) or 'none'}")
    saved = dict(_VARIANTS)
    _VARIANTS.update(selection)
    try:
        yield
    finally:
        _VARIANTS.clear()
        _VARIANTS.update(saved)


def ops_with_variants(family: Optional[str] = None) -> List[Op]:
    """The ops that have launch variants (of one kernel module ``family``, e.g. ``"moe"``)."""
    return [o for _, o in sorted(_all_ops().items()) if o.variants and (family is None or o.family == family)]


def dispatch_modified(overrides: bool = True) -> bool:
    """True while an override, a non-default variant or a :func:`recording` is active: CUDA graphs
    must not replay then (a replay runs the captured kernels and makes no Python calls).
    ``overrides=False``: leave overrides out of the question (for a caller that keys its graphs by
    :func:`override_key`, ``ds4t.batch.graphs.capture_overrides``); variants and recordings still count."""
    return bool(_VARIANTS) or bool(_RECORDERS) or (overrides and bool(_ACTIVE_OVERRIDES))


def override_key() -> Tuple[Tuple[str, int], ...]:
    """The overrides active now as a hashable key: ((op name, id of the function that runs), ...),
    sorted; ``()`` when none. Two calls give equal keys exactly when the same functions would run
    (a CUDA graph captured under one key replays those functions' kernels)."""
    return tuple(sorted((n, id(o.impl)) for n, o in _OPS.items() if o.overrides))


# ----------------------------------------------------------------------------------------------
# Calls through the registry
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OpCall:
    """One recorded call: op name, what ran, and its output (tensors detached and cloned)."""
    name: str
    label: str         # Op.label() at call time
    overridden: bool
    output: Any
    seconds: float = 0.0   # wall time of the call (with a CUDA sync on either side when timed)


_RECORDERS: List[List[OpCall]] = []
_TIMED: List[bool] = []   # per active recorder: synchronise CUDA around each call


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _snapshot(out):
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_snapshot(o) for o in out)
    return out


@contextlib.contextmanager
def recording(timed: bool = False) -> Iterator[List[OpCall]]:
    """Log every op call made through :data:`ops` inside the block into the yielded list
    (:class:`OpCall`: name, label, output; ``seconds`` per call, CUDA synchronised around each call
    when ``timed``: a per-op profile of a step). CUDA graphs do not replay while it records."""
    log: List[OpCall] = []
    _RECORDERS.append(log)
    _TIMED.append(timed)
    try:
        yield log
    finally:
        i = next(i for i, r in enumerate(_RECORDERS) if r is log)
        del _RECORDERS[i], _TIMED[i]


ADVISORY_KWARGS = ("out_dtype", "same_slot_runs")
"""Keywords an override may leave out of its signature: storage and launch hints whose readers get the
same values either way (``same_slot_runs``, the step's runs of one slot, :class:`ds4t.kernels.splits.SameSlotRuns`,
or None: :func:`ds4t.kernels.attention.decode_attention` may share K / V tiles among a prefill chunk's rows, and
it and :func:`ds4t.kernels.mla.mla_decode` fold a long run's splits in one program, same bits). A model asks a
norm (``DecoderModel.norm_dtype``), ``silu_mul``, ``linear_heads``,
``decode_attention``, ``gdn_decode`` or ``gated_rms_norm`` (``blocks.narrow_store``) for
``out_dtype=torch.bfloat16`` only where every reader rounds the output to bf16, so an override that returns fp32 feeds them the same values; a call drops these keywords for an
override that cannot take them."""


def _call_override(o: Op, fn: Callable, args, kwargs):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # a builtin without a signature: just call it
        return fn(*args, **kwargs)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        trimmed = {k: v for k, v in kwargs.items() if k not in ADVISORY_KWARGS}
        if len(trimmed) < len(kwargs):
            try:
                sig.bind(*args, **trimmed)
            except TypeError:
                pass
            else:
                return fn(*args, **trimmed)
        passed = ", ".join([f"<{type(a).__name__}>" for a in args] + [f"{k}=..." for k in kwargs])
        raise TypeError(f"override of op {o.name!r} by {describe(fn)}{sig} cannot take the call "
                        f"{o.name}({passed}): {e}. The op's signature is "
                        f"{o.name}{inspect.signature(o.fn)}") from None
    return fn(*args, **kwargs)


def call_override(name: str, fn: Callable, *args, **kwargs):
    """Call ``fn`` with op ``name``'s arguments as the dispatcher calls an override of it: the
    :data:`ADVISORY_KWARGS` it cannot take are dropped (a tool that runs a replacement beside the
    kernel, e.g. a shadow comparison, gets the same calls an installed override would)."""
    return _call_override(op(name), fn, args, kwargs)


def call(name: str, *args, **kwargs):
    """Run op ``name`` (its override, else the ds4t launcher) on the arguments, as :data:`ops` does."""
    return _run(op(name), args, kwargs)


def _run(o: Op, args, kwargs):
    if not _RECORDERS:
        return _dispatch(o, args, kwargs)
    timed = any(_TIMED)
    if timed:
        _sync()
    t0 = time.perf_counter()
    out = _dispatch(o, args, kwargs)
    if timed:
        _sync()
    dt = time.perf_counter() - t0
    rec = OpCall(o.name, o.label(), o.overridden, _snapshot(out), dt)
    for log in _RECORDERS:
        log.append(rec)
    return out


def _dispatch(o: Op, args, kwargs):
    if o.overrides:
        return _call_override(o, o.overrides[-1][1], args, kwargs)
    return o.fn(*args, **kwargs)


class _Ops:
    """Attribute access to the registered ops: ``ops.linear(x, w)`` calls op ``"linear"`` (or its
    override). What the models use."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            o = op(name)
        except UnknownOpError as e:
            raise AttributeError(str(e)) from None

        def dispatch(*args, **kwargs):
            return _run(o, args, kwargs)

        dispatch.__name__ = dispatch.__qualname__ = name
        dispatch.__doc__ = f"Op {name!r} through the registry (see ds4t.kernels.registry)."
        setattr(self, name, dispatch)   # later look-ups skip __getattr__
        return dispatch

    def __dir__(self):
        return op_names()

    def __repr__(self) -> str:
        return f"<ds4t ops: {', '.join(op_names())}>"


ops = _Ops()
"""The registered ops by attribute: ``ops.linear(x, weight, bias)``; see the module docstring."""
