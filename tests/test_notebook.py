"""examples/challenge.ipynb runs top to bottom in a Jupyter kernel (nbclient) and shows a trials table, a plot and a
submission that passes the challenge's check: the notebook cannot rot."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from latentsweep.trainers.data.sets import load_test  # noqa: E402
from latentsweep.trainers.data.demo import default_test_path  # noqa: E402
from latentsweep.trainers.eval.submission import check_submission  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "challenge.ipynb"


def outputs(nb, kind: str) -> list:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if kind in out.get("data", {})]


@pytest.mark.slow
def test_the_challenge_notebook_runs_and_shows_a_table_a_plot_and_a_submission(tmp_path, monkeypatch):
    monkeypatch.setenv("LATENTSWEEP_NOTEBOOK_FAST", "1")  # the kernel inherits it: 3 trials, a 2-fold pick
    monkeypatch.delenv("LATENTSWEEP_STATE_DIR", raising=False)  # ./mlruns of the notebook's directory
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert errors == []
    tables = [out["data"]["text/html"] for out in outputs(nb, "text/html")]
    assert any("COMPLETE" in html and "optim.lr" in html for html in tables)  # the trials table
    images = outputs(nb, "image/png")
    assert images and base64.b64decode(images[0]["data"]["image/png"]).startswith(b"\x89PNG")  # the plot
    test = load_test(default_test_path())
    assert check_submission(tmp_path / "submission.csv", test)[0] == len(test.ids)
    assert (tmp_path / "mlruns" / "optuna.db").is_file()
    printed = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "demo test MRR: 0." in printed
