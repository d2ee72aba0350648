"""Every ds4t kernel waits for its predecessor before touching memory, and every launch passes
``ds4t.backend.LAUNCH``: the contract that makes programmatic dependent launch (ds4t.backend.PDL) safe.

A kernel launched with PDL that read memory before ``grid_dependency()`` could read its predecessor's
output half-written; nothing at run time would say so (the race shows only on some GPUs, some runs).
So the contract is checked on the source, with a negative control for the checker. The GPU test then
checks that PDL changes no bit: the same steps with ``DS4T_PDL=0`` in a fresh process."""
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


def _launch_keywords(node) -> bool:
    """``**LAUNCH``, ``**LAUNCH_SERIAL`` or a conditional choosing between them."""
    if isinstance(node, ast.IfExp):
        return _launch_keywords(node.body) and _launch_keywords(node.orelse)
    return isinstance(node, ast.Name) and node.id in ("LAUNCH", "LAUNCH_SERIAL")


def contract_violations(sources: dict) -> list:
    """``sources``: {file name: source}. Returns what breaks the contract: a launched kernel whose first
    statement (after its docstring) is not ``grid_dependency()``, a launch without ``**LAUNCH``, a launched
    name with no kernel defined."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    launched, out = set(), []
    for name, tree in trees.items():
        for call in _launches(tree):
            launched.add(call.func.value.id)
            if not any(k.arg is None and _launch_keywords(k.value) for k in call.keywords):
                out.append(f"{name}:{call.lineno}: {call.func.value.id} launched without **LAUNCH")
    defined = set()
    for name, tree in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name not in launched:
                continue
            defined.add(fn.name)
            body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
            first = body[0] if body else None
            ok = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                  and isinstance(first.value.func, ast.Name) and first.value.func.id == "grid_dependency"
                  and not first.value.args)
            if not ok:
                out.append(f"{name}:{fn.lineno}: kernel {fn.name} does not start with grid_dependency()")
    out += [f"{k}: launched, but defined in no checked file" for k in sorted(launched - defined)]
    return out


def test_every_kernel_waits_and_every_launch_passes_launch():
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert sum(1 for s in sources.values() for _ in _launches(ast.parse(s))) >= 30   # the checker sees them
    assert contract_violations(sources) == []


def test_contract_checker_negative_control():
    good = '''
@triton.jit
def _a_kernel(x):
    """doc"""
    grid_dependency()
    tl.store(x, 1)

def run(x):
    _a_kernel[(1,)](x, **LAUNCH)
'''
    assert contract_violations({"good.py": good}) == []
    late = good.replace('    grid_dependency()\n    tl.store(x, 1)', '    tl.store(x, 1)\n    grid_dependency()')
    assert any("does not start with grid_dependency" in v for v in contract_violations({"late.py": late}))
    bare = good.replace(", **LAUNCH", "")
    assert any("without **LAUNCH" in v for v in contract_violations({"bare.py": bare}))
    chosen = good.replace("**LAUNCH)", "**(LAUNCH_SERIAL if x else LAUNCH))")
    assert contract_violations({"chosen.py": chosen}) == []
    other = good.replace("**LAUNCH)", "**(LAUNCH_SERIAL if x else OPTS))")
    assert any("without **LAUNCH" in v for v in contract_violations({"other.py": other}))
    orphan = "def run(x):\n    _b_kernel[(1,)](x, **LAUNCH)\n"
    assert any("defined in no checked file" in v for v in contract_violations({"good.py": good, "run.py": orphan}))


def _decorated(fn: ast.FunctionDef, what: str) -> bool:
    """Is ``fn`` decorated with ``triton.<what>`` (or ``<what>``), called or not?"""
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Attribute) and d.attr == what) or (isinstance(d, ast.Name) and d.id == what):
            return True
    return False


def constexpr_violations(sources: dict) -> list:
    """``NAME: tl.constexpr = f(...)`` with ``f`` a ``@triton.jit`` function of a checked file: the
    interpreter and newer Triton accept it, but Triton 3.6 (what the H200 runs) makes a jit function's result a
    runtime value, and a loop step or a constexpr built from it fails to compile there. Such helpers must be
    ``@triton.constexpr_function``."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    jit = {fn.name for t in trees.values() for fn in ast.walk(t)
           if isinstance(fn, ast.FunctionDef) and _decorated(fn, "jit")}
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.annotation, ast.Attribute)
                    and node.annotation.attr == "constexpr" and node.value is not None):
                continue
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in jit:
                    out.append(f"{name}:{node.lineno}: constexpr from jit function {call.func.id}()")
    return out


def test_no_constexpr_comes_from_a_jit_function():
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert constexpr_violations(sources) == []
    bad = '''
@triton.jit
def _step(G: tl.constexpr):
    return 32 * G

@triton.constexpr_function
def _fine(G):
    return 32 * G

@triton.jit
def k(G: tl.constexpr):
    A: tl.constexpr = _fine(G)
    STEP: tl.constexpr = _step(G) // 2
'''
    assert constexpr_violations({"bad.py": bad}) == ["bad.py:13: constexpr from jit function _step()"]


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
print(json.dumps({"pdl": backend.PDL, "logits": out}))
'''


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-glm", "tiny-deepseek"])
def test_pdl_changes_no_bit(preset):
    def run(pdl: str):
        env = {**os.environ, "DS4T_PDL": pdl}
        r = subprocess.run([sys.executable, "-c", _STEPS, preset], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    on, off = run("1"), run("0")
    assert on["pdl"] is True and off["pdl"] is False
    assert on["logits"] == off["logits"]
