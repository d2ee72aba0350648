"""The one place that decides how Triton kernels run, and that works around the interpreter.

On a machine with a CUDA GPU, kernels compile with Triton for that GPU. Without one, they run
through the Triton interpreter on the CPU (``TRITON_INTERPRET=1``), which must be set before
``triton`` is first imported; importing :mod:`ds4t` does that.

Interpreter defects handled here (docs/design.md, "The Triton interpreter"), each with a test in tests/test_backend.py:

* ``tl.dot`` on bf16 tiles multiplies raw bit patterns, and on fp32 tiles it is a BLAS sgemm
  whose result for a row depends on the row's place in the tile (OpenBLAS works in 6-row
  panels) -> :func:`mma` computes a broadcast product summed over K in fp32 (bf16*bf16 products
  are exact in fp32, so only the summation order differs from the GPU).
* fp32 -> bf16 ``.to()`` truncates instead of rounding to nearest even -> :func:`_fast_float_conversions`
  rounds it as the GPU does (:func:`round_bf16_in_f32`'s bits) and serves every float conversion from a
  table (16-bit and 8-bit sources) or a shift, where Triton's own ``_convert_float`` ran ~20 numpy passes
  (with ``DS4T_INTERPRETER_REPATCH=1`` :func:`cast` rounds with integer ops instead).
* autotune with several configs and ``do_bench`` need a GPU -> kernels use one fixed config
  per weight shape (which batch invariance wants anyway); :func:`timer` times with CUDA events
  on the GPU and wall clock on the CPU.
* the interpreter re-patches ``triton.language`` on every launch (~3 ms) and checks every int32
  op for overflow (compiled kernels don't, outside debug mode); :func:`_keep_interpreter_patched`
  patches once and turns the check off, which makes tiny models usable on the CPU.
* the interpreter looks up every op's numpy dtype by building an 18-entry dict (~35 us a call,
  5-16 % of an interpreted model step) -> :func:`_memoize_np_dtype`; and every op's result builds
  its ``triton.language`` block type and tensor anew, re-validating the shape and formatting the
  type's name -> :func:`_reuse_block_types`; tile loads read lane by lane in C++ -> :func:`_gather_loads`.
"""
from __future__ import annotations

import os
import sys
import time

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Multiply-add fusion changes rounding; triton 3.9 warns its default flips in 3.10. Pin today's
# default so results do not change under us (batch invariance holds either way).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run in the Triton interpreter (on the CPU)."""

if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError(
        "ds4t: no CUDA GPU and triton was imported before ds4t without TRITON_INTERPRET=1; "
        "import ds4t first or set TRITON_INTERPRET=1"
    )

_INTERPRET_C = tl.constexpr(INTERPRET)
PATCH_INTERPRETER = INTERPRET and os.environ.get("DS4T_INTERPRETER_REPATCH") != "1"
"""Whether the interpreter work-arounds at the end of this module are applied (``DS4T_INTERPRETER_REPATCH=1`` keeps
Triton's own interpreter behaviour)."""
_ROUND_BF16_C = tl.constexpr(INTERPRET and not PATCH_INTERPRETER)
"""Whether :func:`cast` rounds fp32 -> bf16 itself: in the interpreter without :func:`_fast_float_conversions`."""


def _pdl_supported() -> bool:
    if INTERPRET or os.environ.get("DS4T_PDL", "1") == "0":
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    try:
        return torch.cuda.get_device_capability()[0] >= 9
    except (AssertionError, RuntimeError):   # no CUDA runtime (a compile-only check that fakes a GPU)
        return False


PDL: bool = _pdl_supported()
"""True when kernels launch with programmatic dependent launch (Hopper and later; ``DS4T_PDL=0`` turns it
off). A kernel launched so may start while the kernel before it in the stream still runs; each ds4t kernel
waits for its predecessor's memory in :func:`grid_dependency` before touching memory, so only the launch
latency and block scheduling overlap, never the arithmetic: results are bitwise those without it."""

def _tma_supported() -> bool:
    if INTERPRET:
        return True   # the interpreter runs tensor-descriptor loads (zero past the tensor's end, as the GPU)
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        return torch.cuda.get_device_capability()[0] >= 9
    except (ImportError, AssertionError, RuntimeError):
        return False


TMA: bool = _tma_supported()
"""True when kernels may load tiles through tensor descriptors (the Tensor Memory Accelerator: Hopper and later,
and the interpreter)."""


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address ``t``: its last dim contiguous, its base and every outer stride a
    multiple of 16 bytes (what the TMA needs; a launch that fails it takes pointer loads)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]))

LAUNCH: dict = {"launch_pdl": True} if PDL else {}
"""Keywords every ds4t kernel launch passes (``kernel[grid](..., **LAUNCH)``)."""

LAUNCH_SERIAL: dict = {}
"""What a launch passes instead of :data:`LAUNCH` when its kernel must not start early: its blocks all fit
on the GPU at once and then run long latency-bound loops. Launched under PDL while the kernel before it
still held SMs, the Gated DeltaNet prefill's 512 one-warp blocks ran 1.65x slower for the whole chunk (0.82
-> 1.36 ms a layer at 1024 tokens on an H200; its first layer, launched after an idle GPU, was not slowed);
launched plainly it starts once its predecessor is done (bench/results/2026-12-04-h200-gdn-dk-state.md)."""

_PDL_C = tl.constexpr(PDL)
if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def grid_dependency():
    """The first statement of every ds4t kernel. Under programmatic dependent launch (:data:`PDL`) it
    waits until the previous kernel in the stream has finished and its writes are visible, then lets the
    next kernel launch (its blocks become resident and wait in their own ``grid_dependency``). Without
    PDL (the interpreter, older GPUs, ``DS4T_PDL=0``) it is nothing."""
    if _PDL_C:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(p):
    """Ask the memory system to bring the 128-byte line of each pointer of tile ``p`` into L2 (PTX
    ``prefetch.global.L2``: a hint, no value, no fault), so that a later load of it waits for L2, not DRAM.
    Nothing in the interpreter. Never changes a value."""
    if not _INTERPRET_C:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


def default_device() -> torch.device:
    """``cuda`` when kernels compile for a GPU, else ``cpu`` (interpreter)."""
    return torch.device("cpu" if INTERPRET else "cuda")


def device_name() -> str:
    if INTERPRET:
        return "cpu (Triton interpreter)"
    return torch.cuda.get_device_name()


@triton.jit
def mma(a, b, acc):
    """acc + a @ b with fp32 accumulation; a [M,K], b [K,N] tiles of the same float dtype.

    fp32 inputs use IEEE fp32 (never TF32): a TF32 result would not match the reference. M must
    be >= 16 for the GPU; keep M a fixed constant so a row's result never depends on the batch.
    """
    if _INTERPRET_C:
        # Not tl.dot: the interpreter runs it as a BLAS sgemm whose micro-kernel works in row
        # panels, so a row's bits depend on where it sits in the tile. A broadcast product
        # summed over K gives every (m, n) the same sequential K order.
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        if a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def round_bf16_in_f32(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32, with integer ops (NaN and
    Inf keep their bits; adding the bias could carry a NaN into Inf): what ``x.to(bf16)`` rounds
    to on the GPU."""
    bits = x.to(tl.uint32, bitcast=True)
    bias = ((bits >> 16) & 1) + 0x7FFF
    finite = (bits & 0x7F800000) != 0x7F800000
    bits = tl.where(finite, bits + bias, bits) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_in_f32(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (bf16 / fp16 / fp32), kept in fp32: the activation operand of
    the FP8 "tf32" route. (Rounding with integer ops instead of the conversion instruction was
    slower on sm_90: ~11 integer ops per element against one F2F.)"""
    if dtype == tl.float32:
        out = x
    else:
        out = cast(x, dtype).to(tl.float32)
    return out


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even for fp32 -> bf16 also in the interpreter.

    (The interpreter still flushes fp32 denormals to zero on this cast.)
    """
    if _ROUND_BF16_C:
        if dtype == tl.bfloat16:
            if x.dtype == tl.float32:
                x = round_bf16_in_f32(x)
    return x.to(dtype)


FP8_ROUTES = {"direct": 0, "f32": 1, "tf32": 2, "fold": 3, "x2": 4, "f16": 5}
"""How a kernel turns fp8 weight tiles into MMA operands (a launch constant, fixed per weight shape):

* ``"direct"``: fp8 -> activation dtype A, A x A tensor-core MMA. On Hopper the fp8 -> bf16 convert
  compiles to an fp8x2 -> f16x2 unpack plus one F2F.BF16.F16 per element (conversion pipe).
* ``"f32"``: fp8 -> fp32 -> A (HADD2.F32 + a packed F2FP per two elements), A x A MMA.
* ``"tf32"`` (A = bf16 or fp16 only): fp8 -> fp32 and x rounded to A then held in fp32, TF32 MMA.
  Both operands have <= 11 significant bits, so TF32 holds them exactly and every product is exact;
  no pack back to 16 bits. A different MMA instruction, so its sums may differ in the last bit from
  the 16-bit routes: like every launch constant it is fixed per weight shape, never per batch.

* ``"fold"`` (A = bf16 or fp16 only): the weight ``fp8 * scale`` computed in fp32 and rounded once to A
  (what a bf16 model holding the dequantized weight computes, e.g. transformers on a dequantized
  checkpoint), multiplied into one accumulator over the whole K: no per-scale-block dot, wait and scaled
  add. Not exact: each weight carries one rounding to A (2^-9 relative for bf16), the same size as the
  activations' own; a kernel choosing it says so in its config table.
* ``"x2"`` (A = bf16 only): no weight conversion at all. Each row of an activation tile, rounded to bf16,
  is scaled by a power of two and split into two fp8 pieces (:func:`fp8_pieces`); the fp8 weight tile
  meets both in fp8 x fp8 tensor-core MMAs (on Hopper a wgmma reads the weight straight from shared
  memory: no registers, no conversion instructions). Not exact, in two ways a row's own values fix
  (never the batch): an element below 2^-9 of its row's largest in the tile keeps fewer than its 8 bits
  (error <= 2^-17 of that largest), and the tensor core adds an fp8 MMA's products with fewer than fp32's
  bits (Hopper keeps ~14 bits past the largest product, measured in DeepSeek-V3's report).
* ``"f16"`` (A = bf16 or fp16): fp8 -> fp16 (Hopper: one packed convert per two values, against four
  instructions per two for fp8 -> bf16), and each activation row, scaled by a power of two so its largest
  lands in [2^14, 2^15), rounded to fp16 (exact for every element of at least 2^-31 of that largest,
  which covers any bf16 row but the most extreme); fp16 x fp16 MMA, every product exact, fp32
  accumulation, the scale undone on fp32 sums. The linear scales per K step (:func:`f16_rows`; a
  program-wide scale would read its x twice); the grouped MoE kernels once per program over its K range
  (a first pass over the pair's activations: the K loop then only multiplies and converts, and every sum
  is the "f32" route's scaled by a power of two -- the interpreter gives the "f32" bits, unswapped
  tiles). On the GPU that holds if the tensor core sums scaled fp16 products as it sums the bf16 ones
  (not measured). Timed on the H200: slower than "f32" in the MoE kernels and the linear
  (bench/results/2026-12-01-h200-peers-32k.md); no table picks it.

"direct", "f32", "tf32" and "f16" compute ``x . (fp8 * scale)`` with every product exact; SASS counted with
cuobjdump (Triton 3.9, sm_90); which is fastest is measured per weight shape (bench/bench_kernels.py --fp8
--sweep, bench/moe_tiles.py --fp8 --routes)."""


def fp8_route(what: str, route: str, act_dtype) -> int:
    """The launch constant of fp8 route ``route`` (:data:`FP8_ROUTES`) for activations of ``act_dtype``;
    ValueError naming ``what`` (the op) for an unknown route or one the activation dtype cannot take
    ("tf32" would round fp32 activations; "fold" rounds every weight, which the fp32 path, held to the
    fp32 oracle bound with exact products, does not allow; "x2" splits a bf16 value's 8 significant bits
    into two fp8 pieces, too few for fp16's 11)."""
    code = FP8_ROUTES.get(route)
    if code is None:
        raise ValueError(f"{what}: fp8_route must be one of {sorted(FP8_ROUTES)}, got {route!r}")
    if route in ("tf32", "fold") and act_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: fp8_route {route!r} needs bf16 or fp16 activations, got {act_dtype}")
    if route == "x2" and act_dtype != torch.bfloat16:
        raise ValueError(f"{what}: fp8_route 'x2' needs bf16 activations, got {act_dtype}")
    if route == "f16" and act_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: fp8_route 'f16' needs bf16 or fp16 activations (fp16 holds 11 significant "
                         f"bits, not fp32's 24), got {act_dtype}")
    return code


@triton.jit
def fp8_operand(w, s, dtype: tl.constexpr, ROUTE: tl.constexpr):
    """An fp8 (e4m3) weight tile as the MMA operand of :data:`FP8_ROUTES` route ROUTE for activation
    dtype ``dtype``; ``s`` the tile's fp32 scales broadcast against it, used by "fold" only (the other
    routes scale each block's dot afterwards)."""
    if ROUTE == 3:
        out = fp8_scaled_to(w, s, dtype)
    else:
        out = fp8_to(w, dtype, ROUTE)
    if FP8_BARRIER:
        if ROUTE != 4:   # "x2" feeds the fp8 tile itself to an fp8 MMA
            out = _layout_barrier(out)
    return out


FP8_LAYOUT_BARRIER: bool = os.environ.get("DS4T_FP8_BARRIER", "0") == "1" and not INTERPRET
"""``DS4T_FP8_BARRIER=1`` (GPU only; off by default, an experiment): every fp8 weight tile, once
converted (:func:`fp8_operand`), passes an identity ``mov`` marked as having side effects. Triton picks a dot operand's
layout from the narrowest load it can trace the operand back to, through side-effect-free elementwise ops only
(AccelerateMatmul's ``computeOrigBitWidth``): traced to an 8-bit load, an mma.sync operand gets kWidth 4, whose K
order inside each MMA step differs from wgmma's kWidth 2 -- why an FP8 row's bits change with the tile where a bf16
row's do not. Stopped at the barrier, the converted tile gets the 16-bit layout (kWidth 2; compiled for sm_90,
tests/test_gpu_compile.py) and the decode K loop of a 7168-column FP8 linear is 1762 SASS instructions instead of
1945. On an H100 that gave FP8 rows the bits of the row tiles: with the switch on, the FP8 row-tile tests of
``tests/kernels/test_linear.py`` and ``test_moe.py`` (skipped on the GPU without it) passed, and GLM-4.5-4l in FP8
kept its chunk invariance (bench/results/2026-12-07-h100-batched-blocks-fp8-barrier.md); its 4096-token prompt
ran no faster (110.2 against 109.4 ms). :func:`ds4t.kernels.linear._gpu_row_tiles` gives FP8 weights a row tile
under it. Off by default: timed (``bench/fp8_layout.py``, an H100), a 1024-row FP8 linear on its row tile takes 31-39 %
less time than on the decode tiles, but the decode tiles themselves get 20-56 % slower and the grouped MoE's 24-41 %
(DeepSeek-V3-4l's FP8 prompt 9 % slower as a whole): in the 16-bit layout the converted tile goes through shared
memory once more each K step (``STS.128`` + ``LDSM`` in the sm_90 loop), where the 8-bit layout converts the
operand in registers as it comes from shared memory. A side-effect-free stop of the trace (a reduction over
``tl.join(v, v)``) compiles to the same SASS, so the cost is the layout's, not the barrier's
(bench/results/2026-12-07-h100-fp8-barrier-row-tiles.md). The interpreter ignores it."""
FP8_BARRIER = tl.constexpr(FP8_LAYOUT_BARRIER)


@triton.jit
def _layout_barrier(v):
    """v unchanged, through an inline-asm ``mov`` Triton must keep (not pure): see :data:`FP8_LAYOUT_BARRIER`."""
    if v.dtype.primitive_bitwidth == 16:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)
    else:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=1)
    return v


@triton.jit
def fp8_to(w, dtype: tl.constexpr, ROUTE: tl.constexpr):
    """An fp8 (e4m3) weight tile as the MMA operand of :data:`FP8_ROUTES` route ROUTE for activation
    dtype ``dtype`` (route 2: fp32; route 4: the fp8 tile itself; route 5: fp16). Exact on every route."""
    if ROUTE == 4:
        out = w
    elif ROUTE == 5:
        out = w.to(tl.float16)
    elif ROUTE == 2:
        out = w.to(tl.float32)
    elif ROUTE == 1:
        if dtype == tl.float32:
            out = w.to(tl.float32)
        else:
            out = cast(w.to(tl.float32), dtype)
    else:
        out = w.to(dtype)
    return out


# Packed exact conversions of the GGUF kernels' small integers to bf16 on the GPU (the interpreter and
# other dtypes convert plainly: the same values). 0x4300 | u is the bf16 128 + u for u < 128, so one
# LOP3 builds two of them in a 32-bit register and one packed bf16 subtraction removes the bias: ~2
# instructions a value instead of the ~5 of a byte extract, an int -> float conversion and a pack.
# Inputs are uint8 tensors; Triton hands an asm block ``pack`` consecutive elements of a thread in one
# register and takes each output's values back packed (two bf16 a 32-bit register).
#
# int8 -> bf16, four bytes a call (Q8_0's best configs use mma.sync's layout, loaded 8 bytes at a time), without
# fp32: prmt puts each byte under a 0x43 high byte (bf16 bits 0x43XX); masking the
# byte's top bit off gives 128 + (q & 127), keeping only it gives 128 (bit clear) or 256 (set, the exponent's
# low bit), and their difference is q exactly. Two bytes a prmt: 8 instructions for four values, where the
# fp32 route (byte into a 2^23 magic, fp32 subtract, pack) takes 11.
_INT8_BF16_ASM = tl.constexpr("""{
.reg .b32 m, t0, t1, l0, l1, h0, h1;
mov.b32 m, 0x43434343;
prmt.b32 t0, $2, m, 0x4140;
prmt.b32 t1, $2, m, 0x4342;
and.b32 l0, t0, 0xFF7FFF7F;
and.b32 h0, t0, 0xFF80FF80;
and.b32 l1, t1, 0xFF7FFF7F;
and.b32 h1, t1, 0xFF80FF80;
sub.rn.bf16x2 $0, l0, h0;
sub.rn.bf16x2 $1, l1, h1;
}""")


@triton.jit
def int8_to(b, dtype: tl.constexpr):
    """int8 tile ``b`` (given as its uint8 bytes) as ``dtype`` values -128..127 (exact)."""
    if _INTERPRET_C or dtype != tl.bfloat16:
        out = cast(((b.to(tl.int32) ^ 128) - 128).to(tl.float32), dtype)
    else:
        out = tl.inline_asm_elementwise(_INT8_BF16_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    return out


def _six_bit_asm(nib: int, pair: int, pack: int) -> str:
    # u = nibble `nib` of each ql byte | bit pair `pair` of its qh byte << 4, in [0, 64), byte by byte (one lop3
    # for `pack` bytes); each u byte under a 0x43 byte is the bf16 128 + u; minus 160 (0x4320) gives u - 32.
    # Inputs: `pack` bytes of ql and of qh; outputs: pack / 2 registers of two values.
    words = pack // 2
    a, b = ("a", "b") if pack == 2 else ("$2", "$3")
    lines = [".reg .b32 a, b, u, m, c, " + ", ".join(f"t{i}" for i in range(words)) + ";"]
    if pack == 2:
        lines += ["mov.b32 a, {$1, 0};", "mov.b32 b, {$2, 0};"]
    if nib:
        lines.append(f"shr.u32 a, {a}, 4;")
        a = "a"
    if pair != 2:
        lines.append(f"shl.b32 b, {b}, {4 - 2 * pair};" if pair < 2 else f"shr.u32 b, {b}, {2 * pair - 4};")
        b = "b"
    lines += [f"and.b32 b, {b}, 0x30303030;", f"lop3.b32 u, {a}, 0x0F0F0F0F, b, 0xEA;", "mov.b32 c, 0x43204320;"]
    if pack == 2:   # the 0x43 bytes by an or, which takes them as an immediate (a prmt needs them in a register)
        lines += ["prmt.b32 t0, u, 0, 0x4140;", "or.b32 t0, t0, 0x43004300;", "sub.rn.bf16x2 $0, t0, c;"]
    else:           # one register of 0x43 bytes serves both prmts
        lines.append("mov.b32 m, 0x43434343;")
        for i in range(words):
            lines += [f"prmt.b32 t{i}, u, m, {0x4140 + 0x202 * i:#06x};", f"sub.rn.bf16x2 ${i}, t{i}, c;"]
    return "{\n" + "\n".join(lines) + "\n}"


_SIX_BIT_ASMS = tl.constexpr(tuple(_six_bit_asm(n, p, pack) for pack in (2, 4) for n in range(2) for p in range(4)))
"""Indexed [8 * (PACK == 4) + 4 * NIB + PAIR]."""
_SIX_BIT_CONSTRAINTS = tl.constexpr(("=r,h,h", "=r,=r,r,r"))


@triton.jit
def six_bit_to(ql, qh, NIB: tl.constexpr, PAIR: tl.constexpr, dtype: tl.constexpr, PACK: tl.constexpr = 2):
    """Q6_K's signed 6-bit values ``(nibble NIB of ql) | (bit pair PAIR of qh) << 4) - 32`` as ``dtype``
    (exact); ql, qh uint8 tiles of one shape. PACK (2 or 4): bytes of each a bf16 bit trick takes at once on
    the GPU, as :func:`nibbles_to`'s (the same values either way)."""
    if _INTERPRET_C or dtype != tl.bfloat16:
        u = ((ql.to(tl.int32) >> (4 * NIB)) & 15) | (((qh.to(tl.int32) >> (2 * PAIR)) & 3) << 4)
        out = cast((u - 32).to(tl.float32), dtype)
    else:
        four: tl.constexpr = PACK == 4
        out = tl.inline_asm_elementwise(_SIX_BIT_ASMS[8 * four + 4 * NIB + PAIR], _SIX_BIT_CONSTRAINTS[four],
                                        [ql, qh], dtype=tl.bfloat16, is_pure=True, pack=PACK)
    return out


def _five_bits_asm(shift: int) -> str:
    # Both nibbles of two qs bytes ($2) with their fifth bits from two qh bytes ($3) shifted right by `shift`
    # (<= 6): bit 0 for the low nibble, bit 1 for the high (the shift moves no bit of the second byte into
    # the first's two lowest). Then each byte to a 16-bit lane (prmt), so the lane shifts stay in their
    # lanes; 0x4300 | u is the bf16 128 + u, minus 128. Two bytes of each input a call, four values out.
    sh = f"shr.u32 h, h, {shift};" if shift else ""
    return f"""{{
.reg .b32 t, h, u, m;
mov.b32 m, 0x43004300;
mov.b32 t, {{$2, 0}};
mov.b32 h, {{$3, 0}};
{sh}
prmt.b32 t, t, 0, 0x4140;
prmt.b32 h, h, 0, 0x4140;
shl.b32 u, h, 4;
lop3.b32 u, u, 0x00100010, m, 0xEA;
lop3.b32 $0, t, 0x000F000F, u, 0xEA;
sub.rn.bf16x2 $0, $0, m;
shr.u32 t, t, 4;
shl.b32 u, h, 3;
lop3.b32 u, u, 0x00100010, m, 0xEA;
lop3.b32 $1, t, 0x000F000F, u, 0xEA;
sub.rn.bf16x2 $1, $1, m;
}}"""


_FIVE_BITS_ASMS = tl.constexpr(tuple(_five_bits_asm(b) for b in range(7)))


@triton.jit
def five_bits_to(qs, qh, BIT: tl.constexpr, dtype: tl.constexpr):
    """Q5_K's 5-bit values (0..31) of uint8 tiles qs, qh of one shape as two ``dtype`` tiles (exact): the low
    nibbles of qs with bit BIT of qh as their fifth bit, and the high nibbles with bit BIT + 1."""
    if _INTERPRET_C or dtype != tl.bfloat16:
        w, h = qs.to(tl.int32), qh.to(tl.int32) >> BIT
        lo = cast(((w & 15) | ((h & 1) << 4)).to(tl.float32), dtype)
        hi = cast(((w >> 4) | ((h & 2) << 3)).to(tl.float32), dtype)
    else:
        lo, hi = tl.inline_asm_elementwise(_FIVE_BITS_ASMS[BIT], "=r,=r,h,h", [qs, qh],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    return lo, hi


# Nibbles, two or four bytes a call (PACK): which is cheaper depends on how the MMA operand layout hands a
# thread its bytes (sm_90 SASS at the table configs, bench/compile_check.py --sass _qlinear). In the wgmma
# layout (Q4_K's 64-row, 4-warp tiles) a thread's byte pairs come from separate 16-bit shared-memory loads:
# two bytes a call; merging two pairs into one register cost ~6 PRMTs per four bytes (Q4_K's loop 430 -> 510
# instructions with four). In the mma.sync layout (Q4_0 / Q4_1 at Q8_0's 2-warp tiles) a thread holds four
# consecutive bytes in one register: four a call, and the loop drops 1208 -> 888 instructions (Q4_0; Q4_1
# 1279 -> 953), the unpacking of each 32-bit word into 16-bit halves gone (PRMT 256 -> 64).
def _nibbles_asm(offset: int, pack: int) -> str:
    # 0x4300 | nibble is the bf16 128 + nibble; minus the bf16 128 + offset (exact) gives nibble - offset.
    # Outputs: low nibbles then high ones, two values a register; input: `pack` bytes.
    c = "m" if offset == 0 else "c"
    bias = "" if offset == 0 else f"mov.b32 c, {(0x4300 + offset) * 0x00010001:#010x};"
    words = pack // 2                      # registers of each output
    src = f"${2 * words}"
    lines = [".reg .b32 m, c, " + ", ".join(f"t{i}" for i in range(words)) + ";", "mov.b32 m, 0x43004300;", bias]
    if pack == 2:
        lines += [f"mov.b32 t0, {{{src}, 0}};", "prmt.b32 t0, t0, 0, 0x4140;"]
    else:
        lines += [f"prmt.b32 t0, {src}, 0, 0x4140;", f"prmt.b32 t1, {src}, 0, 0x4342;"]
    for half in range(2):                  # low nibbles, then (shifted) high nibbles
        if half:
            lines += [f"shr.u32 t{i}, t{i}, 4;" for i in range(words)]
        for i in range(words):
            out = f"${half * words + i}"
            lines += [f"lop3.b32 {out}, t{i}, 0x000F000F, m, 0xEA;", f"sub.rn.bf16x2 {out}, {out}, {c};"]
    return "{\n" + "\n".join(line for line in lines if line) + "\n}"


_NIBBLES_BF16_ASMS = tl.constexpr(tuple(_nibbles_asm(off, pack) for pack in (2, 4) for off in (0, 8)))
"""Indexed [2 * (PACK == 4) + SIGNED]."""
_NIBBLES_CONSTRAINTS = tl.constexpr(("=r,=r,h", "=r,=r,=r,=r,r"))


@triton.jit
def nibbles_to(b, dtype: tl.constexpr, SIGNED: tl.constexpr = False, PACK: tl.constexpr = 2):
    """(low, high) nibbles of uint8 tile ``b`` as ``dtype`` values 0..15, or (SIGNED, Q4_0's) -8..7 = nibble - 8
    (exact): two tiles of b's shape. PACK (2 or 4): bytes a bf16 bit trick takes at once on the GPU -- the
    same values either way; 4 where the MMA operand layout gives a thread four consecutive bytes (mma.sync
    tiles), 2 in the wgmma layout (see _nibbles_asm)."""
    if _INTERPRET_C or dtype != tl.bfloat16:
        w = b.to(tl.int32)
        lo = cast(((w & 15) - 8 * SIGNED).to(tl.float32), dtype)
        hi = cast(((w >> 4) - 8 * SIGNED).to(tl.float32), dtype)
    else:
        four: tl.constexpr = PACK == 4
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_BF16_ASMS[2 * four + SIGNED], _NIBBLES_CONSTRAINTS[four], [b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=PACK)
    return lo, hi


@triton.jit
def fma_bf16(a, b, c):
    """``a * b + c`` rounded once to bf16 (nearest, ties to even): one packed ``fma.rn.bf16x2`` per two
    elements on the GPU. a, b, c bf16 tiles of one shape. The interpreter computes the sum in fp64 (exact
    for bf16 operands within 2^37 of each other) and rounds it once from the fp64 bits (normal bf16
    range: the GGUF fold route's weights, never near 2^-126)."""
    if _INTERPRET_C:
        v = a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)
        bits = v.to(tl.uint64, bitcast=True)
        bits = (bits + (((bits >> 45) & 1) + 0xFFFFFFFFFFF)) & 0xFFFFE00000000000
        out = bits.to(tl.float64, bitcast=True).to(tl.float32).to(tl.bfloat16)
    else:
        out = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                        dtype=tl.bfloat16, is_pure=True, pack=2)
    return out


@triton.jit
def fp8_scaled_to(w, s, dtype: tl.constexpr):
    """fp8 tile ``w`` times fp32 scales ``s`` (broadcast against it), in fp32, rounded once to ``dtype``:
    the operand of :data:`FP8_ROUTES` ``"fold"``."""
    return cast(w.to(tl.float32) * s, dtype)


@triton.jit
def _round_4_bits(v):
    """fp32 v rounded to 4 significant bits (nearest, ties to even), with integer ops."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3_exact(v):
    """fp32 v rounded (nearest, ties to even) to a value fp8 e4m3 holds, for |v| < 448: 4 significant
    bits from 2^-6 up, multiples of 2^-9 below (e4m3's subnormals). Rounded here rather than by the
    conversion because the interpreter's fp32 -> fp8 loses a carry into the exponent (127 -> 64)."""
    grid = (v + 24576.0) - 24576.0   # 3 * 2^13: fp32's spacing there is 2^-9
    return tl.where(tl.abs(v) >= 0.015625, _round_4_bits(v), grid)


@triton.jit
def row_pow2_scale(v, TOP: tl.constexpr):
    """(scale, inv) fp32 [M], powers of two, for an fp32 tile v [M, K] (TOP >= 2): row r's largest |v|
    times scale lies in [2^TOP, 2^(TOP + 1)) and inv = 1 / scale. A row of zeros (or whose largest is
    below 2^(TOP - 126)) gets scale 2^126, inv 2^-126: both stay normal."""
    return pow2_scale(tl.max(tl.abs(v), axis=1), TOP)


@triton.jit
def pow2_scale(amax, TOP: tl.constexpr):
    """:func:`row_pow2_scale` from the rows' largest magnitudes ``amax`` fp32 [M] (>= 0)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF          # biased exponent of the row's largest
    e = tl.maximum(e, TOP + 1)                                  # keeps both powers of two normal
    scale = ((TOP + 254 - e) << 23).to(tl.float32, bitcast=True)   # 2^(TOP + 127 - e)
    inv = ((e - TOP) << 23).to(tl.float32, bitcast=True)           # 2^(e - 127 - TOP)
    return scale, inv


@triton.jit
def f16_rows(x):
    """Route "f16"'s activations: (x16 float16 [M, K], inv fp32 [M] a power of two) for a tile x [M, K] of
    bf16 or fp16 values, x = x16 * inv[:, None] exactly for every element of at least 2^-31 of its row's
    largest |x|max (below: error <= 2^-25 of a scaled unit, 2^-39 |x|max). Row r is scaled so |x|max lands
    in [2^14, 2^15) (fp16 holds up to 65504); an 8- or 11-bit value of at least 2^-17 (2^-14) there sits on
    fp16's grid. A row's values depend on its own elements only."""
    v = x.to(tl.float32)
    scale, inv = row_pow2_scale(v, 14)
    return f16_scaled(v, scale), inv


@triton.jit
def f16_scaled(x, scale):
    """Tile x [M, K] (bf16 / fp16 values) times its rows' power-of-two ``scale`` [M] (:func:`pow2_scale`
    with TOP 14), in fp16: exact where :func:`f16_rows` says."""
    return (x.to(tl.float32) * scale[:, None]).to(tl.float16)


@triton.jit
def mma_rows(w, x16, inv, SWAP: tl.constexpr):
    """w . x as a fresh fp32 tile for an fp16 weight tile and :func:`f16_rows`' (x16, inv): SWAP w [N, K]
    -> [N, M] (w @ x^T), else w [K, N] -> [M, N]; the row's inverse scale applied to the MMA's sum."""
    if SWAP:
        out = mma(w, tl.trans(x16), tl.zeros([w.shape[0], x16.shape[0]], dtype=tl.float32)) * inv[None, :]
    else:
        out = mma(x16, w, tl.zeros([x16.shape[0], w.shape[1]], dtype=tl.float32)) * inv[:, None]
    return out


@triton.jit
def fp8_pieces(x):
    """Route "x2"'s split of an activation tile x [M, K] (bf16 values, any float dtype): (x1, x2, inv),
    x1 and x2 float8e4nv [M, K], inv fp32 [M] a power of two, with x = (x1 + x2) * inv[:, None] exactly
    for every element of at least 2^-9 of its row's largest magnitude |x|max (smaller ones: error
    <= 2^-17 |x|max). Row r is scaled by 2^(7 - floor(log2 |x|max)), so its largest lands in [128, 256)
    (fp8 e4m3 holds up to 448); x1 rounds that to e4m3 (4 significant bits), x2 = the rest rounded to
    e4m3 (at most 4 more bits: exact while they lie on e4m3's 2^-9 grid). A row's pieces depend on its
    own values only."""
    v = x.to(tl.float32)
    scale, inv = row_pow2_scale(v, 7)
    v = v * scale[:, None]
    x1 = _to_e4m3_exact(v)
    x2 = _to_e4m3_exact(v - x1)
    return x1.to(tl.float8e4nv), x2.to(tl.float8e4nv), inv


@triton.jit
def mma_fp8_pieces(w, x1, x2, inv, SWAP: tl.constexpr):
    """w . x for an fp8 weight tile and the pieces of x (:func:`fp8_pieces`) as a fresh fp32 tile: SWAP w
    [N, K] -> [N, M] (w @ x^T: the weight rows fill the MMA's M side, the wgmma form), else w [K, N] ->
    [M, N]. Both pieces go through one accumulator (x1 first), then the row's inverse scale."""
    if SWAP:
        p = mma(w, tl.trans(x1), tl.zeros([w.shape[0], x1.shape[0]], dtype=tl.float32))
        p = mma(w, tl.trans(x2), p)
        out = p * inv[None, :]
    else:
        p = mma(x1, w, tl.zeros([x1.shape[0], w.shape[1]], dtype=tl.float32))
        p = mma(x2, w, p)
        out = p * inv[:, None]
    return out


@triton.jit
def split_sum(ptrs, mask, stride, SPLIT: tl.constexpr, CG: tl.constexpr = False):
    """fp32 ``p[0] + p[1] + ... + p[SPLIT-1]`` of the split-K partials at ``ptrs + s * stride`` (masked
    entries 0), added left to right: the one order every consumer of split partials sums them in (the
    linear's split-K sum, the grouped MoE kernels, the MoE combine), so a fused and a separate sum give
    the same bits. CG: load past L1 (partials another program of the same launch just wrote)."""
    if CG:
        acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ptrs + s * stride, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        acc = tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ptrs + s * stride, mask=mask, other=0.0)
    return acc


@triton.jit
def split_sum_bias(ptrs, mask, stride, SPLIT: tl.constexpr, b_ptrs, HAS_BIAS: tl.constexpr):
    """:func:`split_sum` of a linear's partials, then its bias at ``b_ptrs`` (masked entries 0): the finished
    output as the linear's split-K sum kernel stores it, for any consumer that finishes it instead."""
    acc = split_sum(ptrs, mask, stride, SPLIT)
    if HAS_BIAS:
        acc += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _pair_halve(x):
    # A sum of two is a + b in any order (IEEE addition commutes), so tl.sum may reduce the pair
    # however the layout has it -- in one thread, by a lane shuffle or through shared memory.
    return tl.sum(tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2]), axis=len(x.shape))


@triton.jit
def pair_sum(x):
    """Sum of fp32 ``x`` [..., n] over its last axis (n a power of two), as a fixed tree: adjacent
    elements added in pairs, then adjacent pair sums, log2(n) times; returns [...].

    Why not ``tl.sum``: its order follows the tensor's layout (threads, warps, registers), which the
    compiler picks per kernel, so two kernels summing the same row may round differently. Here every
    addition's operands are fixed by n alone -- the same bits in any kernel, layout, warp count, and in
    the interpreter -- so a norm recomputed inside another kernel (a fused prologue) gives the norm
    kernel's bits. Zeros past the data change nothing (x + 0 == x), so callers pad to a power of two.
    The tree over n is the tree over each aligned power-of-two chunk, then over the chunk sums."""
    for _ in tl.static_range(16):
        if x.shape[-1] > 1:
            x = _pair_halve(x)
    return tl.reshape(x, x.shape[:-1])


@triton.jit
def scaled_add(acc, p, s):
    """acc + p * s rounded once (a fused multiply-add): how a block-scaled kernel adds a scale block's
    dot p times its scale s. Written as ``acc + p * s`` the compiler may or may not contract it into an
    FMA, a choice that can differ between kernels; spelled out, every kernel and the interpreter (whose
    fma also rounds once) round it the same way."""
    return tl.fma(p, s, acc)


@triton.jit
def mma_tf32_exact(a, b, acc):
    """acc + a @ b, fp32 tiles whose values are exact in TF32 (<= 11 significant bits, e.g. bf16 /
    fp16 / fp8 values held in fp32): TF32 tensor cores, every product exact, fp32 accumulation."""
    if _INTERPRET_C:
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    return acc


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)), the one sigmoid of every kernel (router scores, GDN beta, the shared-expert
    gate, gated norms and gated attention): a value computed by two kernels must get the same bits,
    so no kernel writes its own formula (``tl.sigmoid`` is this expression in triton 3.6-3.9, but
    not promised to stay so)."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus (beta=1, threshold=20) with an accurate log1p(exp(x)):
    log1p(e) = log(u) * e / (u - 1), u = 1 + e (exact when u == 1)."""
    e = tl.exp(x)
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def silu(x):
    """x / (1 + exp(-x)), the one SiLU formula of the fused kernels (MoE experts, causal conv)."""
    return x / (1.0 + tl.exp(-x))


TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype for a torch float dtype (pass as a constexpr)."""
    try:
        return TORCH_TO_TL[dtype]
    except KeyError:
        raise TypeError(f"ds4t kernels support float32/bfloat16/float16, not {dtype}") from None


def timer(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn()``: CUDA events on the GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if INTERPRET:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _keep_interpreter_patched() -> None:
    """Patch ``triton.language`` for the interpreter once instead of on every launch.

    The interpreter swaps every builtin of ``triton.language`` for an interpreted one before
    each launch and swaps it back after (~3 ms a launch, more than a small kernel's work).
    On a CPU-only process nothing ever compiles Triton for real, so the patched state can stay.
    Set DS4T_INTERPRETER_REPATCH=1 to keep Triton's own behaviour.
    """
    from triton.runtime import interpreter as _interp

    original = _interp._patch_lang
    if getattr(original, "_ds4t_cached", False):
        return
    state = {}

    class _NoRestore:
        def restore(self):
            pass

    lang_modules = (tl, tl.core)
    keys = {}  # id(fn.__globals__) -> which language modules it names

    def patch_once(fn):
        # Triton patches whichever of tl / tl.core the function's globals name; patch each
        # combination once.
        g = fn.__globals__
        key = keys.get(id(g))
        if key is None:
            key = keys[id(g)] = tuple(sorted({id(v) for v in g.values() if any(v is m for m in lang_modules)}))
        if key not in state:
            state[key] = original(fn)
        return _NoRestore()

    patch_once._ds4t_cached = True
    patch_once._ds4t_original = original
    patch_once._ds4t_scopes = state   # key -> the scope of Triton's patching (restore() undoes it)
    _interp._patch_lang = patch_once
    # Compiled kernels only check integer overflow in debug mode; the interpreter checks every
    # int32 multiply/add by default, which costs ~30% of its time. Match the compiled default.
    import dataclasses

    _interp.interpreter_builder.options = dataclasses.replace(
        _interp.interpreter_builder.options, sanitize_overflow=False)


def _memoize_np_dtype() -> None:
    """Answer the interpreter's ``_get_np_dtype`` from a table keyed on the element type's name.

    Triton rebuilds a dict of 18 numpy dtypes on every call, and calls it for every op of every
    program: measured 5-7 % of a tiny model's interpreted decode step and 16 % of a 576 x 3072
    linear launch (scratch timing, 2026-12-03). The answer depends only on the element type (a
    pointer is uint64, a block type its element's), so the first answer per name is kept.
    Set DS4T_INTERPRETER_REPATCH=1 to keep Triton's own function (with the rest of Triton's behaviour).
    """
    import numpy as np
    from triton.runtime import interpreter as _interp

    original = getattr(_interp, "_get_np_dtype", None)
    if original is None or getattr(original, "_ds4t_memo", False):
        return
    u64 = np.dtype(np.uint64)
    memo = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        out = memo.get(tt_dtype.name)
        if out is None:
            out = memo[tt_dtype.name] = original(tt_dtype)
        return out

    np_dtype._ds4t_memo = True
    np_dtype._ds4t_original = original
    _interp._get_np_dtype = np_dtype


def _reuse_block_types() -> None:
    """Build ``triton.language`` block types and tensors from what an earlier one of the same shape computed.

    In the interpreter every op's result constructs a ``block_type`` (shape unwrapped and checked for
    powers of two, numel, a formatted name) and a ``tensor`` (a tuple of ``constexpr`` per dimension):
    Python work per op that outweighs a small tile's numpy work. The attributes depend only on the
    element type's name and the shape, so the first construction of each (name, shape) is kept and
    later ones copy it; a shape that is not a list (or ``tl.tuple``) of plain ints, or an invalid one, takes
    Triton's own path (which raises as before). Measured 12-14 % off a tiny model's interpreted decode
    steps (scratch timing, 2026-12-03). Compiled kernels never run this. DS4T_INTERPRETER_REPATCH=1
    keeps Triton's constructors.
    """
    from triton.language import core

    block_init, orig_tensor_init = core.block_type.__init__, core.tensor.__init__
    if getattr(block_init, "_ds4t_reuse", False):
        return
    # Triton's shapes are ``tl.tuple`` objects (a values list and a tuple_type); each instance gets its
    # own tl.tuple over the kept values and type, as Triton's constructors give each their own.
    new_tuple = object.__new__
    blocks = {}     # (element type name, dims) -> (dims, shape's tuple_type, numel, name)
    tensors = {}    # dims -> (numel, dims as constexprs, shape's tuple_type)

    def shape_of(values, shape_type):
        """A new ``tl.tuple`` over a copy of ``values`` with type ``shape_type``: what ``tl.tuple(values,
        shape_type)`` builds, without its per-element copy loop and type checks."""
        shape = new_tuple(core.tuple)
        shape.values = values.copy()
        shape.type = shape_type
        return shape

    def plain_dims(shape):
        dims = shape if type(shape) is list else shape.values if type(shape) is core.tuple else None
        if dims is None:
            return None
        for d in dims:
            if type(d) is not int:
                return None
        return tuple(dims)

    def block_type_init(self, element_ty, shape):
        dims = plain_dims(shape)
        key = None if dims is None else (element_ty.name, dims)
        hit = None if key is None else blocks.get(key)
        if hit is None:
            block_init(self, element_ty, shape)
            if key is not None and type(self.shape) is core.tuple:
                blocks[key] = (list(self.shape.values), self.shape.type, self.numel, self.name)
            return
        values, shape_type, self.numel, self.name = hit
        self.element_ty = element_ty
        self.shape = shape_of(values, shape_type)

    def tensor_init(self, handle, type_):
        # a block type's shape holds the ints its constructor unwrapped and checked
        dims = (tuple(type_.shape.values) if type(type_.shape) is core.tuple else None) if type_.is_block() else ()
        hit = None if dims is None else tensors.get(dims)
        if hit is None:
            orig_tensor_init(self, handle, type_)
            if dims is not None and type(self.shape) is core.tuple:
                tensors[dims] = (self.numel, list(self.shape.values), self.shape.type)
            return
        self.handle = handle
        self.type = type_
        self.dtype = type_.scalar
        self.numel, values, shape_type = hit
        self.shape = shape_of(values, shape_type)

    block_type_init._ds4t_reuse = True
    block_type_init._ds4t_original = block_init
    tensor_init._ds4t_original = orig_tensor_init
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init


class _Memory:
    """``n`` elements of numpy dtype ``dt`` at address ``addr``, as numpy's array interface (no copy)."""

    def __init__(self, addr: int, n: int, dt):
        self.__array_interface__ = {"data": (addr, True), "shape": (n,), "typestr": dt.str, "version": 3}


_GATHER_MIN = 256           # elements: below this Triton's own gather is as fast
_GATHER_SPAN = 1 << 40      # bytes: a load over a wider range (several allocations) takes Triton's path


def _gather_loads() -> None:
    """Serve the interpreter's tile loads by numpy fancy indexing instead of Triton's element-by-element gather.

    Triton's ``create_masked_load`` reads each lane's address in a C++ loop (~20 ns an element: 1.3-2 ms for
    a [128, 512] fp32 weight tile, a quarter of an interpreted linear). Here the lanes the mask selects are
    read as one numpy gather over the address range they span (a view of that memory through numpy's array
    interface; only the selected elements are read), and the others take ``other`` as before. The same bytes
    land in the same lanes: a load whose selected addresses are not whole elements from the lowest, or that
    spans more than 2^40 bytes, or is small, takes Triton's path.

    The result is C-ordered whatever the pointers' layout, as Triton's own load returns it: numpy's
    reductions follow memory layout (pairwise along a contiguous axis, sequential across one), so a
    transposed load tile would change the K order of the interpreter's :func:`mma` and with it a row's bits
    (numpy's fancy indexing keeps the index array's layout, hence the explicit order).
    """
    import numpy as np
    from triton.runtime import interpreter as _interp

    builder = _interp.InterpreterBuilder
    original = builder.create_masked_load
    if getattr(original, "_ds4t_gather", False):
        return

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        p, m = ptrs.data, mask.data
        if p.size < _GATHER_MIN or m.shape != p.shape:
            return original(self, ptrs, mask, other, cache_policy, is_volatile)
        dtype_tt = ptrs.get_element_ty()
        dt = _interp._get_np_dtype(dtype_tt)
        everything = bool(m.all())
        sel = p if everything else p[m]
        if sel.size == 0:
            return original(self, ptrs, mask, other, cache_policy, is_volatile)
        lo, hi = int(sel.min()), int(sel.max())
        span = hi - lo + dt.itemsize
        if span > _GATHER_SPAN:
            return original(self, ptrs, mask, other, cache_policy, is_volatile)
        off = sel - np.uint64(lo)
        idx = off // np.uint64(dt.itemsize)
        if not np.array_equal(idx * np.uint64(dt.itemsize), off):
            return original(self, ptrs, mask, other, cache_policy, is_volatile)
        mem = np.asarray(_Memory(lo, span // dt.itemsize, dt))
        got = mem[np.ascontiguousarray(idx, dtype=np.intp)]   # C order, as Triton's
        if everything:
            return _interp.TensorHandle(got, dtype_tt)
        if other is None:
            out = np.zeros(p.shape, dtype=dt)
        else:
            out = np.array(np.broadcast_to(other.data, p.shape), dtype=dt, order="C")
        out[m] = got
        return _interp.TensorHandle(out, dtype_tt)

    create_masked_load._ds4t_gather = True
    create_masked_load._ds4t_original = original
    builder.create_masked_load = create_masked_load


def _fast_float_conversions() -> None:
    """Float conversions in the interpreter: the GPU's fp32 -> bf16 rounding, and each conversion one numpy pass.

    Triton's ``_convert_float`` decodes sign, exponent and significand in ~20 numpy passes (with a Python loop
    over the mantissa bits when any element is subnormal): a quarter of an interpreted FP8 MoE call. Here a
    source of at most 16 bits is looked up in a table of that function's own results for every bit pattern
    (built once per conversion, so the same bits by construction); fp32 -> bf16 is the top half of the word
    (what that function gives for every exponent but zero; zero-exponent words still go through it).

    And ``create_fp_trunc`` (``x.to(tl.bfloat16)`` of fp32, and a store's implicit cast) truncated where the GPU
    rounds to nearest even: it now rounds with :func:`round_bf16_in_f32`'s integer operations (ties to even,
    NaN and Inf keep their bits) before taking the top half, the bits :func:`cast` gave."""
    import numpy as np
    from triton.runtime import interpreter as _interp

    original = _interp._convert_float
    if getattr(original, "_ds4t_fast", False):
        return
    tables = {}
    half = np.uint32(16)

    def top_half(bits):
        """fp32 words -> bf16 words as ``original`` truncates them."""
        out = (bits >> half).astype(np.uint16)
        odd = ((bits & np.uint32(0x7F800000)) == 0) & ((bits & np.uint32(0x7FFFFF)) != 0)
        if odd.any():
            out[odd] = original(bits[odd], tl.float32, tl.bfloat16, None)
        return out

    def convert(input, input_dtype, output_dtype, rounding_mode):
        width = input_dtype.primitive_bitwidth
        if width <= 16:
            key = (str(input_dtype), str(output_dtype), rounding_mode)
            if key not in tables:
                try:
                    tables[key] = original(np.arange(1 << width, dtype=f"uint{width}"), input_dtype, output_dtype,
                                           rounding_mode)
                except (OverflowError, ValueError):   # Triton's function fails on some pattern: keep it per call
                    tables[key] = None
            table = tables[key]
            if table is not None:
                return table[np.frombuffer(input.tobytes(), dtype=f"uint{width}")].reshape(input.shape)
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None:
            return top_half(np.frombuffer(input.tobytes(), dtype=np.uint32)).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    builder = _interp.InterpreterBuilder
    trunc = builder.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data).view(np.uint32)
            bias = ((bits >> half) & np.uint32(1)) + np.uint32(0x7FFF)
            finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
            rounded = np.where(finite, bits + bias, bits) & np.uint32(0xFFFF0000)
            return _interp.TensorHandle(top_half(rounded).reshape(src.data.shape), dst_type.scalar)
        return trunc(self, src, dst_type)

    convert._ds4t_fast = True
    convert._ds4t_original = original
    _interp._convert_float = convert
    builder.create_fp_trunc = create_fp_trunc


def _fast_binary_semantics() -> None:
    """The interpreter's type promotion and broadcasting of a binary op, without Triton's ``tl.tuple`` round trips.

    Every binary ``tl`` op runs ``binary_op_type_checking_impl`` (scalar types, pointer rules, a computation
    type, a cast of each operand) and then ``broadcast_impl_value``, which compares the two block shapes
    through ``tl.tuple`` objects rebuilt on every comparison and index: a quarter to a half of an interpreted
    kernel's Python (py-spy over tests/kernels/test_attention.py and tests/exactness, 2026-12-07). Two cases
    are answered here with plain lists, the same tensors, types and numpy broadcasts as Triton's code:

    - both operands tensors of one non-pointer element type (the computation type is that type and both casts
      are no-ops), or a pointer and an integer tensor where the op allows that pointer: straight to broadcasting
      -- except a division or modulo of floats narrower than fp32, which Triton promotes to fp32;
    - broadcasting two blocks of equal rank whose shapes are lists of ints: each dimension is the other's, or
      1; the result shape is computed once per pair of shapes.

    Anything else (Python scalars, mixed element types, ranks that differ, incompatible shapes) takes Triton's
    own functions, errors included. Compiled kernels never run this. DS4T_INTERPRETER_REPATCH=1 keeps Triton's
    functions."""
    from triton.language import core
    from triton.runtime import interpreter as _interp

    semantic = type(_interp.interpreter_semantic)
    check, broadcast = semantic.binary_op_type_checking_impl, semantic.broadcast_impl_value
    if getattr(check, "_ds4t_fast", False):
        return
    tensor, tuple_, block_type = core.tensor, core.tuple, core.block_type
    shapes = {}   # (lhs dims, rhs dims) -> result dims (a list), or None where Triton must decide

    def result_dims(lv, rv):
        key = (tuple(lv), tuple(rv))
        if key in shapes:
            return shapes[key]
        out = []
        for left, right in zip(lv, rv):
            if type(left) is not int or type(right) is not int or not (left == 1 or right == 1 or left == right):
                out = None
                break
            out.append(right if left == 1 else left)
        shapes[key] = out
        return out

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if lt.is_block() and rt.is_block():
            ls, rs = lt.shape, rt.shape
            if type(ls) is tuple_ and type(rs) is tuple_:
                lv, rv = ls.values, rs.values
                if lv == rv:
                    return lhs, rhs
                if len(lv) == len(rv):
                    dims = result_dims(lv, rv)
                    if dims is not None:
                        if lv != dims:
                            lhs = self.make_tensor(self.builder.create_broadcast(lhs.handle, dims),
                                                   block_type(lt.scalar, dims))
                        if rv != dims:
                            rhs = self.make_tensor(self.builder.create_broadcast(rhs.handle, dims),
                                                   block_type(rt.scalar, dims))
                        return lhs, rhs
        return broadcast(self, lhs, rhs)

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                     arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            ld, rd = lhs.dtype, rhs.dtype
            if ld.is_ptr():
                if allow_lhs_ptr and rd.is_int():
                    return broadcast_impl_value(self, lhs, rhs)
            elif rd.is_ptr():
                if allow_rhs_ptr and ld.is_int():
                    return broadcast_impl_value(self, lhs, rhs)
            elif (ld is rd or ld.name == rd.name) and not (
                    div_or_mod and ld.is_floating() and ld.primitive_bitwidth < 32):
                return broadcast_impl_value(self, lhs, rhs)
        return check(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    binary_op_type_checking_impl._ds4t_fast = True
    binary_op_type_checking_impl._ds4t_original = check
    broadcast_impl_value._ds4t_original = broadcast
    semantic.binary_op_type_checking_impl = binary_op_type_checking_impl
    semantic.broadcast_impl_value = broadcast_impl_value


def _fast_constexpr_unwrap() -> None:
    """``tl.core._unwrap_if_constexpr`` answering its common arguments before Triton's isinstance chain.

    Triton calls it on nearly every argument of every ``tl`` op (2.2 million calls in six tiny-GLM exactness
    tests): a ``constexpr`` gives its value, an int, float, bool, string, None or tensor is returned as it is,
    anything else (lists, tuples, subclasses) goes to Triton's function. Compiled kernels never run this.
    DS4T_INTERPRETER_REPATCH=1 keeps Triton's function."""
    from triton.language import core

    original = core._unwrap_if_constexpr
    if getattr(original, "_ds4t_fast", False):
        return
    constexpr = core.constexpr
    plain = frozenset((int, float, bool, str, type(None), core.tensor))

    def unwrap(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t in plain:
            return o
        return original(o)

    unwrap._ds4t_fast = True
    unwrap._ds4t_original = original
    core._unwrap_if_constexpr = unwrap


def _direct_builtin_calls() -> None:
    """The interpreter's stand-ins for ``tl`` builtins call the builtin's own function with the semantic, directly.

    The interpreter replaces every builtin of ``triton.language`` (``tl.load``, ``tensor.__add__``, ...) by a
    lambda that copies its keyword arguments into a new dict without ``_semantic`` and calls the builtin, whose
    ``@builtin`` wrapper then checks that ``_semantic`` was given and calls the function: two Python frames and a
    dict comprehension on every op, ~7 % of an interpreted FP8 MoE test's time (py-spy, 2026-12-08). Here the
    stand-in sets ``_semantic`` in the keyword arguments it received and calls the function ``@builtin``
    wrapped (its check always passes: the stand-in gives the semantic); a member that is not ``@builtin``'s
    wrapper is called as Triton's stand-in calls it. The same function runs with the same arguments. Compiled
    kernels never run this; DS4T_INTERPRETER_REPATCH=1 keeps Triton's stand-ins."""
    from triton.language import core
    from triton.runtime import interpreter as _interp

    original = _interp._patch_attr
    if getattr(original, "_ds4t_direct", False):
        return
    wrapper_code = core.builtin(lambda _semantic=None: None).__code__   # the code of every @builtin wrapper

    def patch_attr(obj, name, member, builder, scope):
        target = member.__wrapped__ if getattr(member, "__code__", None) is wrapper_code else member
        semantic = _interp.interpreter_semantic

        def stand_in(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return target(*args, **kwargs)

        scope.set_attr(obj, name, stand_in)

    patch_attr._ds4t_direct = True
    patch_attr._ds4t_original = original
    _interp._patch_attr = patch_attr


if PATCH_INTERPRETER:
    _direct_builtin_calls()
    _keep_interpreter_patched()
    _memoize_np_dtype()
    _reuse_block_types()
    _gather_loads()
    _fast_float_conversions()
    _fast_binary_semantics()
    _fast_constexpr_unwrap()
