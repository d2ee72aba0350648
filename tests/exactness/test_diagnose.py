"""diagnose names the first op whose rows differ, through the registry, overrides by name."""
import sys
import textwrap

import pytest

import ds4t
from ds4t import cli
from ds4t.exactness.diagnose import diagnose
from ds4t.kernels import override
from ds4t.kernels.linear import linear


def batch_dependent_linear(x, weight, bias=None, *, out=None):
    """Sums K in two halves whenever the launch has more than one row: a row's bits depend on B."""
    if x.shape[0] == 1:
        return linear(x, weight, bias, out=out)
    h = x.shape[1] // 2
    y = linear(x[:, :h].contiguous(), weight[:, :h].contiguous(), bias)
    y = y + linear(x[:, h:].contiguous(), weight[:, h:].contiguous())
    if out is not None:
        out.copy_(y)
        return out
    return y


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


def test_native_step_agrees_op_by_op(model):
    d = diagnose(model, sessions=3, ctx=6)
    assert d.first is None and d.logits_equal
    assert len(d.calls) > 10 and all(c.rows_compared == 3 for c in d.calls if c.op != "norm_rope_write_kv")


def test_names_an_overridden_batch_dependent_linear(model):
    with override("linear", batch_dependent_linear):
        d = diagnose(model, sessions=3, ctx=6)
    f = d.first
    assert f is not None and not d.logits_equal
    assert f.op == "linear" and f.overridden
    assert f.label == f"linear (overridden by {__name__}.batch_dependent_linear)"
    # the ops before it agree: it is the first linear call, the cause and not a consequence
    assert all(not c.differs for c in d.calls[:f.index])
    assert f"first op whose rows differ: {f.label}" in d.summary()


def test_cli_import_applies_a_modules_overrides(tmp_path, monkeypatch, capsys):
    mod = "ds4t_test_user_kernels"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(f"""
        import ds4t
        from {__name__} import batch_dependent_linear
        HANDLE = ds4t.kernels.override("linear", batch_dependent_linear)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rc = cli.main(["diagnose", "--import", mod, "--model", "tiny-qwen", "--sessions", "2", "--ctx", "4"])
    finally:
        if mod in sys.modules:
            sys.modules.pop(mod).HANDLE.restore()
    out = capsys.readouterr().out
    assert rc == 1
    assert f"first op whose rows differ: linear (overridden by {__name__}.batch_dependent_linear)" in out


def test_cli_import_of_a_missing_module_is_one_line(capsys):
    assert cli.main(["check", "--import", "no_such_module_ds4t"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ds4t check: error: --import no_such_module_ds4t: No module named 'no_such_module_ds4t'", err
