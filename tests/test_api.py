"""The Python API: re-exported lazily by `import latentsweep` (no import cost for the CLI and workers), one-line errors
as
the CLI's; the whole flow runs in tests/test_notebook.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

import latentsweep
from latentsweep.search import api
from latentsweep.trainers.core.errors import LatentsweepError


def test_import_search_does_not_load_the_api():
    code = "import sys, latentsweep; assert 'latentsweep.search.api' not in sys.modules and 'mlflow' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_the_api_is_reexported_from_search():
    for name in latentsweep.API:
        assert getattr(latentsweep, name) is getattr(api, name)
    with pytest.raises(AttributeError):
        latentsweep.no_such_function  # noqa: B018


def test_presets_is_a_table_of_the_bundled_studies():
    table = api.presets()
    assert list(table.columns) == ["name", "description"] and "quickstart" in set(table["name"])


def test_an_unknown_pick_option_names_the_valid_ones():
    with pytest.raises(LatentsweepError, match="unknown option.*fold.*valid: .*folds"):
        api.pick_ensemble("anything", fold=3)


def test_a_missing_study_is_a_one_line_error(tmp_path):
    with pytest.raises(LatentsweepError) as info:
        api.trials("nothing-here", state_dir=str(tmp_path))
    assert len(str(info.value).splitlines()) == 1
