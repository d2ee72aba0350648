"""Every ds4t kernel waits for its predecessor before touching memory (the one exception: an L2 prefetch of
weights, which no kernel writes), and every launch passes ``ds4t.backend.LAUNCH``: the contract that makes
programmatic dependent launch (ds4t.backend.PDL) safe.

A kernel launched with PDL that read memory before ``grid_dependency()`` could read its predecessor's
output half-written; nothing at run time would say so (the race shows only on some GPUs, some runs).
So the contract is checked on the source, with a negative control for the checker. The GPU test then
checks that PDL (and the L2 prefetch) change no bit: the same steps with ``DS4T_PDL=0`` and with
``DS4T_L2_PREFETCH=1`` in fresh processes."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ds4t

PACKAGE = pathlib.Path(ds4t.__file__).parent


def _launches(tree: ast.AST):
    """Calls ``name[grid](...)`` with ``name`` ending in ``_kernel``."""
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)
                and n.func.value.id.endswith("_kernel")):
            yield n


# What a kernel may call before grid_dependency(): index math, and the L2 prefetch of its weights.
PRE_WAIT_CALLS = {"program_id", "arange", "minimum", "maximum", "zeros", "full", "multiple_of", "max_contiguous",
                  "cdiv", "to", "prefetch_l2"}


def _pre_wait_problem(stmts) -> str:
    """Why the statements before a kernel's wait are not allowed there ('' if they are)."""
    for st in stmts:
        if isinstance(st, (ast.For, ast.While, ast.With, ast.Return)):
            return f"a {type(st).__name__.lower()} statement"
        for n in ast.walk(st):
            if isinstance(n, ast.Call):
                f = n.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "?")
                if name not in PRE_WAIT_CALLS:
                    return f"a call to {name}()"
    return ""


def contract_violations(sources: dict) -> list:
    """``sources``: {file name: source}. Returns what breaks the contract: a launched kernel without exactly
    one top-level ``grid_dependency()``, or with anything before it but index math and ``prefetch_l2`` (no
    load, no store, no other helper), a launch without ``**LAUNCH``, a launched name with no kernel defined."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    launched, out = set(), []
    for name, tree in trees.items():
        for call in _launches(tree):
            launched.add(call.func.value.id)
            if not any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "LAUNCH"
                       for k in call.keywords):
                out.append(f"{name}:{call.lineno}: {call.func.value.id} launched without **LAUNCH")
    defined = set()

    def is_wait(st):
        return (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Name)
                and st.value.func.id == "grid_dependency" and not st.value.args)

    for name, tree in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name not in launched:
                continue
            defined.add(fn.name)
            body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
            waits = [i for i, st in enumerate(body) if is_wait(st)]
            nested = sum(1 for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") ==
                         "grid_dependency") - len(waits)
            if len(waits) != 1 or nested:
                out.append(f"{name}:{fn.lineno}: kernel {fn.name} must call grid_dependency() once, at its top level")
                continue
            why = _pre_wait_problem(body[:waits[0]])
            if why:
                out.append(f"{name}:{fn.lineno}: kernel {fn.name} has {why} before grid_dependency()")
    out += [f"{k}: launched, but defined in no checked file" for k in sorted(launched - defined)]
    return out


def test_every_kernel_waits_and_every_launch_passes_launch():
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert sum(1 for s in sources.values() for _ in _launches(ast.parse(s))) >= 30   # the checker sees them
    assert contract_violations(sources) == []


def test_contract_checker_negative_control():
    good = '''
@triton.jit
def _a_kernel(x, w):
    """doc"""
    i = tl.program_id(0).to(tl.int64) * 4 + tl.arange(0, 4)
    if HEADS:
        w += i
    prefetch_l2(w + i, 64)
    grid_dependency()
    tl.store(x + i, tl.load(w + i))

def run(x, w):
    _a_kernel[(1,)](x, w, **LAUNCH)
'''
    assert contract_violations({"good.py": good}) == []
    bad = {
        "load before the wait": good.replace("prefetch_l2(w + i, 64)", "v = tl.load(w + i)"),
        "store before the wait": good.replace("prefetch_l2(w + i, 64)", "tl.store(x + i, 1)"),
        "helper before the wait": good.replace("prefetch_l2(w + i, 64)", "v = _helper(w)"),
        "loop before the wait": good.replace("prefetch_l2(w + i, 64)", "for j in range(2):\n        i += 1"),
        "no wait": good.replace("    grid_dependency()\n", ""),
        "wait twice": good.replace("    grid_dependency()\n", "    grid_dependency()\n    grid_dependency()\n"),
        "nested wait": good.replace("    grid_dependency()\n", "    if HEADS:\n        grid_dependency()\n"),
    }
    for what, src in bad.items():
        assert contract_violations({"k.py": src}), what
    bare = good.replace(", **LAUNCH", "")
    assert any("without **LAUNCH" in v for v in contract_violations({"bare.py": bare}))
    orphan = "def run(x):\n    _b_kernel[(1,)](x, **LAUNCH)\n"
    assert any("defined in no checked file" in v for v in contract_violations({"good.py": good, "run.py": orphan}))


_STEPS = r'''
import json, random, sys
import torch, ds4t
from ds4t import backend
model = ds4t.load(sys.argv[1], device="cuda")
rng = random.Random(0)
sessions = [model.new_session(96) for _ in range(5)]
for s in sessions:
    s.prefill([rng.randrange(200) for _ in range(rng.randint(3, 40))])
out = []
for step in range(4):
    res = ds4t.eval_batch([ds4t.DecodeItem(s, 7 + step) for s in sessions], mode="native")
    out.append(res.logits.double().cpu().view(torch.int64).tolist())
print(json.dumps({"pdl": backend.PDL, "prefetch": backend.L2_PREFETCH, "logits": out}))
'''


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-glm", "tiny-deepseek"])
def test_pdl_changes_no_bit(preset):
    def run(pdl: str, prefetch: str = "0"):
        env = {**os.environ, "DS4T_PDL": pdl, "DS4T_L2_PREFETCH": prefetch}
        r = subprocess.run([sys.executable, "-c", _STEPS, preset], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    on, off, pre = run("1"), run("0"), run("1", prefetch="1")
    assert on["pdl"] is True and off["pdl"] is False and pre["prefetch"] is True
    assert on["logits"] == off["logits"] == pre["logits"]
