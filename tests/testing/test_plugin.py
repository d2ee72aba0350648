"""The pytest plugin as a researcher's own repository meets it: examples/researcher_repo run by
pytest in a subprocess, outside tests/, with the plugin found through its declared entry point."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "researcher_repo"
PLUGIN = "ds4t.testing.plugin"


def _declared_pytest11() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]


def test_entry_point_is_declared():
    assert _declared_pytest11() == {PLUGIN: PLUGIN}


def test_installed_entry_point_matches_the_declaration():
    try:
        eps = importlib.metadata.distribution("ds4t").entry_points
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ds4t is imported from a checkout, not installed")
    if not any(ep.group == "pytest11" for ep in eps):
        pytest.skip("the installed ds4t metadata predates its pytest11 entry point: reinstall (pip install -e .)")
    assert {ep.name: ep.value for ep in eps if ep.group == "pytest11"} == _declared_pytest11()


def _researcher_repo(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the example repository and an environment in which ds4t is this checkout and
    pytest finds the plugin through the entry point pyproject.toml declares (a dist-info on the path,
    as an install writes it)."""
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE, repo)
    site = tmp_path / "site"
    info = site / "ds4t_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ds4t-entry-point\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in _declared_pytest11().items()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    return repo, env


def _pytest(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)


def test_researcher_repo_passes_with_the_plugin(tmp_path):
    """The example's kernel test, hypothesis properties (no deadline: the plugin's profile) and
    assert_native_exact on a preset, with the plugin named by -p and by the entry point at once."""
    repo, env = _researcher_repo(tmp_path)
    r = _pytest(repo, env, "-p", PLUGIN, "-v")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"({ROOT / 'ds4t'}): kernels on" in out, out   # this checkout's ds4t, not an installed one
    for test in ("test_matches_reference", "test_rows_invariant", "test_native_path_exact[tiny-glm]",
                 "test_session_mixes_exact"):
        assert f"{test} PASSED" in out, out


BATCH_DEPENDENT = '''

_fixed_chunk = rms_norm


def rms_norm(x, weight, eps=1e-6, *, out=None):
    """The classic mistake: a reduction chunk chosen from the batch size. (A chunk of 2 gives each
    lane 100 sequential adds: the sum moves by a few ulp, enough to survive the rsqrt's rounding in
    about half of the rows on the CPU and the GPU; a chunk of 16 moved too few rows to fail reliably.)"""
    return _fixed_chunk(x, weight, eps, out=out, block_k=2 if x.shape[0] > 1 else 64)
'''


def test_researcher_repo_catches_a_batch_dependent_kernel(tmp_path):
    """Negative control: the same tests, the kernel's reduction chunk now chosen from B. It still
    matches the reference; the row-invariance property fails. The plugin comes from the entry
    point alone here (no -p)."""
    repo, env = _researcher_repo(tmp_path)
    with open(repo / "my_kernels.py", "a") as f:
        f.write(BATCH_DEPENDENT)
    r = _pytest(repo, env, "-v", "-k", "matches_reference or rows_invariant")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "test_matches_reference PASSED" in out and "test_rows_invariant FAILED" in out, out
    assert "differs between batch of" in out, out
