"""Presets: the bundled study files are listed, run by name, copied out to edit, and packaged into the wheel."""
from __future__ import annotations

import contextlib
import io
import tomllib
from pathlib import Path

import pytest
import setuptools

from latentsweep.search.cli.main import main
from latentsweep.search.study.presets import init_preset, preset_names, presets_dir, resolve_study_path
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_every_bundled_study_file_is_a_preset():
    assert preset_names() == sorted(p.stem for p in (ROOT / "studies").glob("*.toml"))
    assert "quickstart" in preset_names() and "full" in preset_names()


def test_a_name_resolves_to_its_preset_and_a_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_study_path("quickstart") == presets_dir() / "quickstart.toml"
    assert resolve_study_path("full.toml") == presets_dir() / "full.toml"
    (tmp_path / "full.toml").write_text("[study]\nname = 'mine'\n")  # a file here wins over the preset
    assert resolve_study_path("full.toml") == Path("full.toml")
    assert resolve_study_path("sub/none.toml") == Path("sub/none.toml")  # paths fail where they are read
    assert load_study_file("quickstart").name == "quickstart"


def test_an_unknown_name_names_the_closest_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["study", "run", "quikstart"])
    assert code == 2
    assert "did you mean 'quickstart'" in err and len(err.strip().splitlines()) == 1


def test_presets_lists_names_and_descriptions():
    code, out, _ = _run(["study", "presets"])
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    assert "successive-halving" in next(line for line in lines if line.startswith("quickstart"))


def test_init_copies_a_preset_with_its_recipes_and_the_copy_loads(tmp_path):
    written = init_preset("union", tmp_path / "my_study.toml")
    recipes = {e["recipe"] for e in tomllib.loads((presets_dir() / "union.toml").read_text())["enqueue"]}
    assert {p.name for p in written} == {"my_study.toml"} | recipes
    study = load_study_file(tmp_path / "my_study.toml")
    assert len(study.enqueue) == len(recipes)


def test_init_renames_the_own_recipe_and_keeps_edits_unless_forced(tmp_path):
    code, out, _ = _run(["study", "init", "full", str(tmp_path / "mine.toml")])
    assert code == 0 and "mine.toml" in out
    text = (tmp_path / "mine.toml").read_text()
    assert 'recipe = "mine.toml"' in text and 'recipe = "full.toml"' not in text
    assert not (tmp_path / "full.toml").exists()
    mine = load_study_file(tmp_path / "mine.toml")
    assert len(mine.enqueue) == 3 and mine.side == ({"model.kind": "knn"},)
    (tmp_path / "mine.toml").write_text(text.replace("n_trials", "n_trials = 5\n# n_trials", 1))
    with pytest.raises(ConfigError, match="exists and differs"):
        init_preset("full", tmp_path / "mine.toml")
    init_preset("full", tmp_path / "mine.toml", force=True)
    assert (tmp_path / "mine.toml").read_text() == text


def test_init_into_a_directory_keeps_the_name(tmp_path):
    code, _, _ = _run(["study", "init", "quickstart", str(tmp_path)])
    assert code == 0
    assert (tmp_path / "quickstart.toml").read_text() == (presets_dir() / "quickstart.toml").read_text()


def test_the_package_list_holds_every_package_and_the_presets():
    """pyproject lists its packages (the presets are mapped in from studies/): a new package must be listed too."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = [f"latentsweep.{name}" for name in setuptools.find_packages(str(ROOT), include=["trainers*", "search*"])]
    assert sorted(tool["packages"]) == sorted(["latentsweep", *found, "latentsweep.search.studies"])
    assert tool["package-dir"] == {"latentsweep.search": "search", "latentsweep.trainers": "trainers",
                                   "latentsweep.search.studies": "studies"}
    assert tool["package-data"]["latentsweep.search.studies"] == ["*.toml"]
