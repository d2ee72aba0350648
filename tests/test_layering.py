"""The dependency direction models -> batch -> step: ds4t.batch imports nothing from ds4t.models
(not even inside a function), and ds4t.step, the step metadata both sides share, imports no ds4t module."""
import ast
import pathlib

import ds4t

PKG = pathlib.Path(ds4t.__file__).parent


def ds4t_imports(source: str):
    """Every ds4t module an import statement in ``source`` names, at any nesting depth."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in out if m == "ds4t" or m.startswith("ds4t.")]


def test_batch_imports_nothing_from_models():
    bad = {p.name: [m for m in ds4t_imports(p.read_text()) if m.startswith("ds4t.models")]
           for p in (PKG / "batch").glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_step_metadata_is_a_leaf():
    assert ds4t_imports((PKG / "step.py").read_text()) == []


def test_checker_sees_a_lazy_import():
    """Negative control: the import the cycle used to come back through (inside a function) is found."""
    src = "def f():\n    from ds4t.models.base import StepBatch\n    import ds4t.models.qwen\n"
    assert ds4t_imports(src) == ["ds4t.models.base", "ds4t.models.base.StepBatch", "ds4t.models.qwen"]


def test_models_reexport_the_step_metadata():
    from ds4t import step
    from ds4t.models import base

    assert base.StepBatch is step.StepBatch and base.to_device is step.to_device
