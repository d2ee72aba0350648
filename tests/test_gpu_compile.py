"""Every kernel the model families launch compiles for an sm_90 GPU (bench/compile_check.py),
checked here without a GPU; its negative control must fail to compile."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ds4t

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "bench", "compile_check.py")
GPU_TRITON = os.environ.get("DS4T_GPU_TRITON", os.path.join(ROOT, ".venv", "triton-gpu"))
"""The GPU machines' Triton release, installed beside the venv's by ``make`` (Makefile: TRITON_GPU): the model
kernels must compile with it -- a release accepts code another refuses (a jit helper's result as a loop step
compiled with 3.9 here and failed on the GPUs' 3.6). Without it the venv's Triton compiles."""


def _gpu_triton_args() -> list:
    return ["--triton", GPU_TRITON] if os.path.isdir(os.path.join(GPU_TRITON, "triton")) else []


def _recorded(setup: str, fn: str, kernel: str) -> list:
    """The records of ``kernel``'s launches made by ``fn`` -- defined in the code ``setup``, which may use json, sys,
    torch and compile_check as ``cc`` -- recorded in an interpreter child as compile_check records them."""
    code = ("import json, sys, torch\nsys.path.insert(0, 'bench')\nimport compile_check as cc\n" + setup +
            f"\nprint(json.dumps([r for r in cc.record([], False, fp8=False, extra=({fn},)) if r['name'] == {kernel!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _stack_bytes(report: str) -> int:
    """The stack a thread of a ``--sass`` report's launch (its spills)."""
    import re

    return int(re.search(r"STACK:(\d+)", report).group(1))


def _gpu_compile_env(**extra) -> dict:
    """The environment of a ``compile_check.py --compile`` child that compiles with the GPUs' Triton (when installed:
    it goes first on the path, as ``--triton`` does), plus ``extra``."""
    env = dict(os.environ, TRITON_INTERPRET="0", **extra)
    if _gpu_triton_args():
        env["PYTHONPATH"] = os.pathsep.join(q for q in (GPU_TRITON, env.get("PYTHONPATH")) if q)
    return env


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="on a GPU the other tests compile every kernel for real")
@pytest.mark.parametrize("scope", ["paths", pytest.param("every-size", marks=pytest.mark.long)])
def test_model_kernels_compile_for_the_gpu(scope):
    """``paths``: every code path of every launch (``--paths-only``: ~100 compiles); ``every-size``: every
    distinct specialization (~210, the tool's default; ``make test-long``)."""
    flags = ["--paths-only"] if scope == "paths" else []
    p = subprocess.run([sys.executable, TOOL, *_gpu_triton_args(), *flags], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " 0 failed" in p.stdout
    if _gpu_triton_args():   # the summary names the release that compiled
        import importlib.metadata as md
        want = next(d.version for d in md.distributions(path=[GPU_TRITON]) if d.metadata["Name"] == "triton")
        assert f"(Triton {want})" in p.stdout, p.stdout[-500:]
    launches = int(p.stdout.strip().splitlines()[-1].split()[0])
    assert launches > 50, p.stdout[-500:]


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="records launches in the interpreter")
def test_launches_noted_without_running_are_the_launches_a_run_makes():
    """compile_check notes launches without running them (the GPU's launcher paths never read a kernel's output
    on the host): a MoE family's decode and mixed steps, run and not run, give the same records in the same order."""
    code = """
import json, sys
sys.path.insert(0, "bench")
import compile_check as cc
print(json.dumps([cc.record(["tiny-qwen"], False, fp8=False, execute=ex) for ex in (False, True)]))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    dry, run = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(dry) > 30 and dry == run


def test_a_kernel_only_the_interpreter_accepts_is_caught(tmp_path):
    from tests.gpu_compile_bad import _loop_with_break_kernel

    if ds4t.backend.INTERPRET:   # the interpreter runs it: rows 0 and 1 summed, then break
        x = torch.randn(5, 16)
        y = torch.empty(16)
        _loop_with_break_kernel[(1,)](x, y, 5, BLOCK=16)
        torch.testing.assert_close(y, x[0] + x[1])
    rec = [{"module": "tests.gpu_compile_bad", "name": "_loop_with_break_kernel",
            "args": {"x_ptr": {"tensor": "float32"}, "y_ptr": {"tensor": "float32"}, "n": 5, "BLOCK": 16}}]
    f = tmp_path / "records.json"
    f.write_text(json.dumps(rec))
    p = subprocess.run([sys.executable, TOOL, "--compile", str(f)], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, TRITON_INTERPRET="0"), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (label, ok, _, err), = json.loads(p.stdout.strip().splitlines()[-1])
    assert label.endswith("_loop_with_break_kernel") and not ok and err


def _compile_records(tmp_path, recs, *extra, env=None):
    """compile_check's [(label, ok, seconds, report)] of ``recs``, compiled in a child (``env``: its environment,
    default the venv's Triton; :func:`_gpu_compile_env` for the GPUs')."""
    f = tmp_path / "records.json"
    f.write_text(json.dumps(recs))
    p = subprocess.run([sys.executable, TOOL, "--compile", str(f), *extra], capture_output=True, text=True, cwd=ROOT,
                       env=env or dict(os.environ, TRITON_INTERPRET="0"), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _copy_record(align16: bool, n_cols: int):
    return {"module": "tests.gpu_compile_bad", "name": "_copy_rows_kernel",
            "args": {"x_ptr": {"tensor": "uint8", "align16": align16}, "y_ptr": {"tensor": "uint8"},
                     "n_cols": n_cols, "BLOCK": 1024, "num_warps": 2}}


def test_launches_compile_with_the_gpu_launchers_specializations(tmp_path):
    """compile_check gives each launch the specializations Triton's launcher would (16-aligned tensors and
    ints divisible by 16: tt.divisibility; ints equal to 1: constexprs), so ``--sass`` reads the GPU's
    code: the aligned row copy uses 16-byte loads. Control: the same launch with x unaligned is compiled to
    byte loads, as the GPU would compile it."""
    (_, ok, _, aligned), (_, ok2, _, unaligned), (_, ok3, _, one) = _compile_records(
        tmp_path, [_copy_record(True, 4096), _copy_record(False, 4096), _copy_record(True, 1)], "--sass", "_copy_rows")
    assert ok and ok2 and ok3
    assert "REG:" in aligned and "LDG.E.128" in aligned and "LDG.E.U8" not in aligned, aligned
    assert "LDG.E.U8" in unaligned, unaligned
    assert "REG:" in one   # n_cols == 1 compiles as the constexpr 1 (test_specialize_follows_the_launcher_rules)


def test_specialize_follows_the_launcher_rules():
    code = """
import json, sys
sys.path.insert(0, "bench")
import compile_check as cc
from tests.gpu_compile_bad import _copy_rows_kernel as k
r = lambda a, n: cc.specialize(k, {"x_ptr": {"tensor": "uint8", "align16": a}, "y_ptr": {"tensor": "uint8"},
                                   "n_cols": n, "BLOCK": 256})
out = {}
for name, (a, n) in {"aligned": (True, 32), "unaligned": (False, 33), "one": (True, 1)}.items():
    sig, consts, attrs = r(a, n)
    out[name] = [sig, {k_: v for k_, v in consts.items()}, sorted(i for (i,) in attrs)]
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, TRITON_INTERPRET="0"), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["aligned"][2] == [0, 1, 2]                 # both pointers and n_cols divisible by 16
    assert out["unaligned"][2] == [1]                     # only y (x unaligned, n_cols 33)
    assert out["one"][0]["n_cols"] == "constexpr" and out["one"][1]["n_cols"] == 1 and out["one"][2] == [0, 1]


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="records launches in the interpreter")
def test_gguf_table_entries_compile_with_their_loops_reported():
    """``--gguf-tables --sass _qlinear``: each measured GGUF table entry compiles at its own K and reports its
    K loop (the instructions-a-weight figures of docs/design.md come from these), the Q4_K entries twice:
    reading the header (FMT 1) and the scale plane (FMT 3), and Q5_K at their configs both ways (FMT 4 / 5);
    Q4_0 and Q4_1 at the Q8_0 entries' configs (FMT 6 / 7)."""
    from ds4t.kernels import qlinear as Q

    p = subprocess.run([sys.executable, TOOL, "--presets", "", "--no-fp8", "--gguf-tables", "--sass", "_qlinear",
                        *_gpu_triton_args()], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0 and " 0 failed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    heads = [line for line in p.stdout.splitlines() if line.startswith("qlinear._qlinear_kernel")]
    q4k = sum(1 for _, _, qt, _ in Q._GPU_TABLE if qt == "Q4_K")
    q80 = sum(1 for _, _, qt, _ in Q._GPU_TABLE if qt == "Q8_0")
    assert len(heads) == len(Q._GPU_TABLE) + 3 * q4k + 2 * q80
    assert all(sum(f"'FMT': {fmt}," in h for h in heads) == q4k for fmt in (3, 4, 5))
    assert all(sum(f"'FMT': {fmt}," in h for h in heads) == q80 for fmt in (6, 7))
    assert sum(1 for line in p.stdout.splitlines() if line.strip().startswith("loop ")) >= len(heads)
    for k, *_ in Q._GPU_TABLE:
        assert f"'K': {k}," in p.stdout, k


def test_sass_digest_ignores_addresses_and_sees_instructions(tmp_path):
    """``--sass`` reports a digest of each launch's SASS: the same launch compiled twice (in two processes) gives
    the same one, and a listing that differs only in addresses and comments too; the control -- the same kernel
    compiled with x unaligned (byte loads instead of 16-byte ones) -- gives another. Launches that differ only in
    a value the launcher does not specialize on (n_cols 4096 / 8192: both multiples of 16) compile once."""
    import re

    (_, ok, _, a), (_, ok3, _, c) = _compile_records(
        tmp_path, [_copy_record(True, 4096), _copy_record(True, 8192), _copy_record(False, 4096)], "--sass", "_copy_rows")
    [(_, ok2, _, b)] = _compile_records(tmp_path, [_copy_record(True, 4096)], "--sass", "_copy_rows")
    assert ok and ok2 and ok3
    digest = lambda rep: re.search(r"SASS digest ([0-9a-f]{16})", rep).group(1)   # noqa: E731
    assert digest(a) == digest(b) != digest(c)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import compile_check as cc

    one = "        /*0000*/                   LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */\n"
    moved = "        /*0010*/  LDC R1, c[0x0][0x28] ;  /* 0x0000000000000000 */\n"
    assert cc.sass_digest(one) == cc.sass_digest(moved) != cc.sass_digest(one.replace("R1,", "R2,"))
    assert cc.sass_digest(one)[1] == 1


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="records launches in the interpreter")
def test_fp8_layout_barrier_gives_converted_fp8_weights_the_16_bit_operand_layout(tmp_path):
    """``DS4T_FP8_BARRIER=1`` (``ds4t.backend.FP8_LAYOUT_BARRIER``): an FP8 decode linear's converted weight tile
    reaches its mma.sync dot in the 16-bit operands' layout (kWidth 2, the layout wgmma tiles use too), compiled
    for sm_90 with the GPUs' Triton. Control: without it the same launch gets kWidth 4 (Triton follows the
    conversion back to the 8-bit load), the layout whose K order inside an MMA step differs from wgmma's."""
    recs = _recorded("""
from ds4t.kernels import linear as L
from ds4t.kernels.weights import quantize
def fp8_decode():
    g = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(128, 512, generator=g) / 16)
    L.linear(torch.randn(1, 512, generator=g), w, None, act_dtype=torch.bfloat16,
             config=L.LinearConfig(block_n=64, block_k=128, split=1, num_warps=2, fp8_route="f32"))
""", "fp8_decode", "_linear_kernel")
    assert len(recs) == 1 and recs[0]["args"]["SCALE_BK"] == 128
    reports = {}
    for barrier in ("0", "1"):
        (label, ok, _, reports[barrier]), = _compile_records(tmp_path, recs, "--layouts", "_linear",
                                                             env=_gpu_compile_env(DS4T_FP8_BARRIER=barrier))
        assert ok, reports[barrier]
    assert "mma.sync" in reports["0"] and "kWidth 4" in reports["0"] and "kWidth 2" not in reports["0"], reports
    assert "mma.sync" in reports["1"] and "kWidth 2" in reports["1"] and "kWidth 4" not in reports["1"], reports


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="records launches in the interpreter")
def test_gguf_moe_gate_up_with_fp32_activations_keeps_its_registers(tmp_path):
    """The GGUF grouped gate/up kernel at Qwen3-Next's expert shape (D 2048, I 512), the GPU table's Q4_K entry and
    fp32 activations (a GGUF file's default), compiled for sm_90: at most 256 bytes of stack a thread (one weight
    after the other, ``qmoe.interleaves``). Control: the same launch interleaved spills kilobytes (what it did)."""
    rec, = _recorded("""
from ds4t.kernels import moe as M
from ds4t.kernels import qmoe as QM
from ds4t.kernels.quant_blocks import quantize
def q4k_fp32():
    g = torch.Generator().manual_seed(0)
    E, I, D = 3, 512, 2048
    wg, wu = (quantize(torch.randn(E, I, D, generator=g) / D ** 0.5, "Q4_K") for _ in range(2))
    wd = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5, "Q4_K")
    with QM.QMOE_CONFIGS.forced(QM.QMOE_CONFIGS.gpu_entries()):
        M.moe_experts(torch.randn(2, D, generator=g), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                      torch.rand(2, 2, generator=g), wg, wu, wd, shared_expert=E - 1, act_dtype=torch.float32)
""", "q4k_fp32", "_qmoe_gate_up_kernel")
    assert rec["args"]["INTERLEAVE"] is False and rec["args"]["FMT"] == 1 and rec["args"]["D"] == 2048
    control = json.loads(json.dumps(rec))
    control["args"]["INTERLEAVE"] = True
    (_, ok, _, rep), (_, ok2, _, rep2) = _compile_records(tmp_path, [rec, control], "--sass", "_qmoe",
                                                          env=_gpu_compile_env())
    stack = [_stack_bytes(rep), _stack_bytes(rep2)]
    assert ok and ok2 and stack[0] <= 256 and stack[1] > 2048, stack


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="records launches in the interpreter")
def test_fp8_moe_down_rows_with_fp32_activations_keep_their_registers(tmp_path):
    """The FP8 grouped down kernel of a 64-row launch (the table's rows entry: row programs, two 16-pair sub-tiles
    with 16-bit activations) at Qwen3-Next's expert shape with fp32 activations, compiled for sm_90: one sub-tile
    (``moe.sub_tiles``), at most 2 KB of stack a thread. Control: the same launch with two sub-tiles spills ~10 KB."""
    rec, = _recorded("""
from ds4t.kernels import moe as M
from ds4t.kernels.weights import quantize
table, rule = dict(M.MOE_CONFIGS.gpu), M.MOE_CONFIGS.gpu_rule
def fp8_fp32_rows():
    g = torch.Generator().manual_seed(0)
    E, I, D, B = 4, 512, 2048, 64
    wg, wu = (quantize(torch.randn(E, I, D, generator=g) / D ** 0.5) for _ in range(2))
    wd = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5)
    ids = torch.randint(0, E - 1, (B, 2), generator=g, dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % (E - 1)
    with M.MOE_CONFIGS.forced(lambda kernel, *f: table[(kernel, *f)] if (kernel, *f) in table else rule(kernel, *f)):
        M.moe_experts(torch.randn(B, D, generator=g), ids, torch.rand(B, 2, generator=g), wg, wu, wd,
                      shared_expert=E - 1, act_dtype=torch.float32)
""", "fp8_fp32_rows", "_moe_down_kernel")
    assert rec["args"].get("M_SUB", 1) == 1 and rec["args"]["ROW_PROGRAMS"] and rec["args"]["SBK"] == 128
    control = json.loads(json.dumps(rec))
    control["args"]["M_SUB"] = 2
    (_, ok, _, rep), (_, ok2, _, rep2) = _compile_records(tmp_path, [rec, control], "--sass", "_moe_down",
                                                          env=_gpu_compile_env())
    stack = [_stack_bytes(rep), _stack_bytes(rep2)]
    assert ok and ok2 and stack[0] <= 2048 and stack[1] > 8192, stack
