"""One tracking-store probe for every scheme (search/tracking/probe.py), used by study pre-flight, pick and the UI:
with the MLflow client's own credentials, a one-line error in seconds, nothing written."""
from __future__ import annotations

import base64
import time

import pytest

from latentsweep.search.tracking.probe import probe_tracking_store
from latentsweep.search.ui.servers import start_ui
from test_bad_input_leftovers import serve  # noqa: F401 - a fixture, used by name
from latentsweep.trainers.core.errors import LatentsweepError

DEAD = {  # a URI per scheme that cannot be used, and the fragment of its one-line error
    "http": ("http://127.0.0.1:9", "MLflow tracking server http://127.0.0.1:9 is not reachable: "),
    "https": ("https://u:hunter2@127.0.0.1:9", "MLflow tracking server https://u:***@127.0.0.1:9 is not reachable"),
    "postgresql": ("postgresql+psycopg2://postgres:hunter2@127.0.0.1:9/x", "is not reachable: "),
    "sqlite": ("sqlite:////nonexistent-dir/mlflow.db", "directory /nonexistent-dir does not exist"),
    "unknown": ("databricks://profile", "scheme 'databricks' is not supported here"),
}


@pytest.mark.parametrize("scheme", sorted(DEAD))
def test_every_scheme_is_probed_in_one_line_within_seconds(scheme):
    uri, fragment = DEAD[scheme]
    start = time.monotonic()
    with pytest.raises(LatentsweepError) as err:
        probe_tracking_store(uri)
    assert fragment in str(err.value) and "\n" not in str(err.value) and "hunter2" not in str(err.value)
    assert time.monotonic() - start < 10


def test_a_new_sqlite_store_and_a_directory_pass_and_nothing_is_written(tmp_path):
    probe_tracking_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    probe_tracking_store(str(tmp_path / "mlruns"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LatentsweepError, match="is a file, not a directory"):
        probe_tracking_store(str(tmp_path / "afile"))


def test_the_probe_sends_the_mlflow_clients_credentials(serve, monkeypatch):  # noqa: F811 - the fixture
    uri = serve(200, "application/json", b'{"experiments": []}', base64.b64encode(b"alice:s3cret").decode())
    with pytest.raises(LatentsweepError, match=r"refused the credentials \(HTTP 401\): set MLFLOW_TRACKING_USERNAME"):
        probe_tracking_store(uri)  # the client would be refused too: said now, not after the training
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    probe_tracking_store(uri)  # the environment's credentials, as MlflowClient sends them


def test_a_failing_server_is_not_called_something_else(serve):  # noqa: F811 - the fixture
    with pytest.raises(LatentsweepError, match=r"failed: HTTP 503 \(down for maintenance\)"):
        probe_tracking_store(serve(503, "text/plain", b"down for maintenance"))


def test_the_ui_probes_a_remote_tracking_server_before_starting_anything(tmp_path):
    with pytest.raises(LatentsweepError, match="MLflow tracking server http://127.0.0.1:9 is not reachable"):
        start_ui(tmp_path / "state", tracking_uri="http://127.0.0.1:9")
    assert not (tmp_path / "state" / "logs").exists()
