"""Every notebook runs top to bottom (small, on the CPU); outputs are stripped in git."""
import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "strip outputs before committing"
    monkeypatch.setenv("DS4T_NB_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()


def test_there_are_notebooks():
    assert NOTEBOOKS
