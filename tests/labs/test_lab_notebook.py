"""The lab's walkthrough notebook: paired with its .py, and it runs top to bottom on the solutions."""

import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = [pytest.mark.subprocess]

LAB = Path(__file__).resolve().parents[2] / "labs/track1/01-attention"


def test_ipynb_and_py_are_in_sync():
    from_py = jupytext.read(LAB / "walkthrough.py")
    from_ipynb = nbformat.read(LAB / "walkthrough.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in from_py.cells] == [(c.cell_type, c.source) for c in from_ipynb.cells], \
        "walkthrough.py and walkthrough.ipynb differ: run `jupytext --sync labs/track1/01-attention/walkthrough.py`"


def run_notebook(tmp_path: Path, lab_file: Path) -> nbformat.NotebookNode:
    shutil.copy(LAB / "walkthrough.ipynb", tmp_path / "walkthrough.ipynb")
    shutil.copy(lab_file, tmp_path / "attention.py")
    nb = nbformat.read(tmp_path / "walkthrough.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def test_runs_top_to_bottom_on_the_solutions(tmp_path):
    nb = run_notebook(tmp_path, LAB / "solutions/attention.py")
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max |yours - torch SDPA|" in text
    assert "-10.7618" in text  # the lesson's Q[0, 0, 1]
    assert "your answer: B" in text and "your answer: A" in text


def test_on_the_stubs_it_stops_at_ex1(tmp_path):
    with pytest.raises(CellExecutionError, match="TODO\\(ex1\\)"):
        run_notebook(tmp_path, LAB / "attention.py")
