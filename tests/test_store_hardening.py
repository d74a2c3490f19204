"""Stores under stress: first-time schema creation raced by several openers, read-only opening, the artifact root
option, and no password on a server's command line."""
from __future__ import annotations

import stat
import threading
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file as study_file
from latentsweep.search.ui import servers
from latentsweep.search.cli.main import main
from latentsweep.search.study.storage import StorageSettings, dispose, open_storage
from latentsweep.trainers.data.synthetic import write_synthetic

PASSWORD = "pa55-w0rd"


def test_first_time_schema_creation_survives_a_race(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    barrier, errors, opened = threading.Barrier(4), [], []

    def first_run():
        barrier.wait()
        try:
            opened.append(open_storage(StorageSettings(url)))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=first_run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(opened) == 4
    optuna.create_study(study_name="raced", storage=opened[0])
    assert [s.study_name for s in optuna.get_all_study_summaries(opened[3])] == ["raced"]
    for storage in opened:
        dispose(storage)


def test_read_only_url_creates_nothing(tmp_path):
    from latentsweep.search.stores import read_only_storage

    with pytest.raises(Exception, match="no Optuna storage"):
        read_only_storage(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


def test_artifact_root_option_places_new_experiments_artifacts(tmp_path, synthetic, capsys):
    sf = study_file(tmp_path, "artroot", n_trials=1, epochs=1)
    state, root = tmp_path / "state", tmp_path / "elsewhere" / "artifacts"
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 "--artifact-root", str(root)]) == 0
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name("artroot")
    assert exp.artifact_location.startswith((str(root), root.as_uri()))
    assert any(p.name == "best.pt" for p in root.rglob("*"))
    assert not (state / "artifacts").exists() or not any((state / "artifacts").rglob("best.pt"))


def test_dashboard_gets_its_storage_from_a_private_file(tmp_path):
    url = f"postgresql+psycopg2://user:{PASSWORD}@db.example:5432/optuna"
    config = servers.dashboard_config(url)
    try:
        argv = servers.dashboard_argv(config, "127.0.0.1", 8080)
        assert all(PASSWORD not in a for a in argv) and argv[argv.index("--from-config") + 1] == str(config)
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        import tomllib

        assert tomllib.loads(config.read_text())["optuna_dashboard"]["storage"] == url
    finally:
        config.unlink()


def test_mlflow_backend_password_goes_to_the_environment():
    uri = f"postgresql+psycopg2://user:{PASSWORD}@db.example/mlflow"
    argv, env = servers.password_to_env(servers.mlflow_argv(uri, "file:///a", "127.0.0.1", 5000, None), {"A": "1"})
    assert all(PASSWORD not in a for a in argv) and "--backend-store-uri" not in argv
    assert env == {"A": "1", "MLFLOW_BACKEND_STORE_URI": uri}
    plain = servers.mlflow_argv("sqlite:///m.db", "file:///a", "127.0.0.1", 5000, None)
    assert servers.password_to_env(plain, {}) == (plain, {})


def test_status_and_pick_read_a_read_only_state_dir(data, existing, tmp_path, capsys):
    """chattr +i: even root cannot create a file in the directory (permission bits would not stop root)."""
    import shutil
    import subprocess

    from bad_input_kit import NAME, one_line_error

    state = tmp_path / "ro"
    shutil.copytree(existing["state"], state)
    if subprocess.run(["chattr", "+i", str(state)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        assert main(["study", "status", NAME, "--state-dir", str(state)]) == 0
        assert "COMPLETE" in capsys.readouterr().out
        pick = ["pick", NAME, "--state-dir", str(state), "--data", str(data["train"]), "--test", str(data["test"]),
                "--out", str(tmp_path / "out" / "sub.csv"), "--top", "1", "--quiet"]
        assert "pass --tracking-uri" in one_line_error(capsys, main(pick))
        assert main([*pick, "--tracking-uri", f"sqlite:///{tmp_path / 'elsewhere.db'}"]) == 0
        assert (tmp_path / "out" / "sub.csv").is_file()
    finally:
        subprocess.run(["chattr", "-i", str(state)], check=True)
