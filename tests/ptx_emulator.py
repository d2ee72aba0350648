"""A small emulator of the PTX that ds4t's packed bit tricks are written in (``ds4t.backend``'s
``inline_asm_elementwise`` strings), so the CPU suite checks the GPU's asm values against the interpreter's
formulas: mov (with ``{lo, hi}`` packing), shr.u32, shl.b32, and.b32, or.b32, prmt.b32 (default mode),
lop3.b32 and sub.rn.bf16x2 -- the instructions those strings use, nothing more (anything else raises)."""
import struct
from typing import Dict

M32 = 0xFFFFFFFF


def bf16_value(bits: int) -> float:
    """The bf16 of the low 16 bits, as a Python float."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits(x: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF   # nearest, ties to even (finite values)


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    if sel & 0x8888:
        raise ValueError("prmt: sign-replicating selectors are not emulated")
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
               for i in range(32))


def _args(rest: str):
    out, depth, cur = [], 0, ""
    for ch in rest:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def run(asm: str, inputs: Dict[int, int]) -> Dict[str, int]:
    """Run ``asm`` (one ``{ ... }`` block) with operand ``$i`` = ``inputs[i]``; returns every register
    written, outputs under their ``$i`` names."""
    regs: Dict[str, int] = {}

    def val(tok: str) -> int:
        if tok.startswith("{"):
            lo, hi = (t.strip() for t in tok.strip("{}").split(","))
            return (val(lo) & 0xFFFF) | ((val(hi) & 0xFFFF) << 16)
        if tok.startswith("$"):
            return regs[tok] if tok in regs else inputs[int(tok[1:])]
        if tok[0].isdigit():
            return int(tok, 0)
        return regs[tok]

    for line in asm.strip().removeprefix("{").removesuffix("}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *a = _args(rest)
        v = [val(t) for t in a]
        if op == "mov.b32":
            r = v[0]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "lop3.b32":
            r = _lop3(v[0], v[1], v[2], v[3])
        elif op == "sub.rn.bf16x2":
            r = sum(_bf16_bits(bf16_value(v[0] >> s) - bf16_value(v[1] >> s)) << s for s in (0, 16))
        else:
            raise ValueError(f"not emulated: {op}")
        regs[d] = r & M32
    return regs


def lanes(bits: int):
    """The two bf16 values of a packed register, low lane first."""
    return bf16_value(bits), bf16_value(bits >> 16)
