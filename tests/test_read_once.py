"""One parse of the study file per process (RunSpec.parsed_study) and one read of the test file
(latentsweep.trainers.data.sets.load_test_shared) while it is unchanged."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest

import latentsweep.search.study.studyfile
import latentsweep.trainers.data.sets
from conftest import main_spent, tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.search.study.spec import build_spec
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.data.sets import load_test_shared
from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every parse of a study file's TOML (latentsweep.search.study.studyfile reads each file through load_toml), from
    here on."""
    seen, real = [], latentsweep.search.study.studyfile.load_toml

    def counted(path, *args, **kwargs):
        seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(latentsweep.search.study.studyfile, "load_toml", counted)
    return seen


def test_a_study_run_parses_its_study_file_once(tmp_path, parses):
    train, _, _ = write_synthetic(tmp_path / "syn", 60, dim_text=8, dim_image=12, n_test=10)
    sf = tiny_study_file(tmp_path, "parseonce", n_trials=2)
    assert main(["study", "run", str(sf), "--data", str(train), "--state-dir", str(tmp_path / "state"),
                 "--quiet"]) == 0
    assert parses == [str(sf)]  # the spec's copy served the pre-flight check, the study's creation and its worker


def test_a_run_parses_its_study_file_and_reads_its_test_file_once(tmp_path, parses, monkeypatch):
    train, test, _ = write_synthetic(tmp_path / "syn", 60, dim_text=8, dim_image=12, n_test=10)
    sf = tiny_study_file(tmp_path, "runonce", n_trials=2)
    reads, real = [], latentsweep.trainers.data.sets.load_test
    monkeypatch.setattr(latentsweep.trainers.data.sets, "load_test", lambda path: reads.append(str(path)) or real(path))
    argv = ["run", str(sf), "--time", "60", "--data", str(train), "--test", str(test),
            "--state-dir", str(tmp_path / "state"), "--quiet"]
    assert main_spent(argv, 50.0) == 0  # 10 s left: the checks, the floor, and what fits of the search
    assert parses == [str(sf)] and reads == [str(test)]  # each was 3 (the checks, pre-flight, the job's judge/floor)


def test_a_spawned_workers_spec_parses_its_own_copy_once(tmp_path, parses):
    sf = tiny_study_file(tmp_path, "spawned")
    spec = build_spec(load_study_file(sf), state=str(tmp_path / "state"))
    assert spec.parsed_study() is spec.parsed_study() and parses == [str(sf)]
    child = pickle.loads(pickle.dumps(spec))  # as multiprocessing hands it to a spawned worker
    assert child.parsed is None  # not pickled: the child's own parse loads the plugin files into its process
    assert child.parsed_study() is child.parsed_study() and parses == [str(sf), str(sf)]
    assert child.parsed_study().name == spec.parsed_study().name == "spawned" and child == spec


def test_the_test_file_is_read_once_while_unchanged(tmp_path, monkeypatch):
    _, test, _ = write_synthetic(tmp_path / "a", 30, dim_text=8, dim_image=12, n_test=5)
    _, other, _ = write_synthetic(tmp_path / "b", 30, dim_text=8, dim_image=12, n_test=7, seed=1)
    seen, real = [], latentsweep.trainers.data.sets.load_test
    monkeypatch.setattr(latentsweep.trainers.data.sets, "load_test", lambda path: seen.append(str(path)) or real(path))
    first = load_test_shared(test)
    assert load_test_shared(test) is first and seen == [str(test)]
    shutil.copyfile(other, test)  # same path, another file's bytes (and size): read again
    os.utime(test, ns=(1, 1))
    assert len(load_test_shared(test).ids) == 7 and len(seen) == 2
    test.unlink()
    with pytest.raises(DataError):  # a file gone since is said as load_test says it, not served from memory
        load_test_shared(test)
