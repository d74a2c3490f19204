"""Tests of latentsweep.search.ui.servers and `latentsweep ui`: real MLflow and optuna-dashboard servers on free ports,
shutdown."""
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import default_sigint
from latentsweep.search.ui import servers
from latentsweep.search.cli import ui as cmd_ui
from latentsweep.search.cli.main import main
from test_bad_input_leftovers import serve  # noqa: F401 - a fixture, used by name
from latentsweep.trainers.core.errors import LatentsweepError

REPO = Path(__file__).resolve().parents[1]


def make_stores(root):
    """A real Optuna study (2 trials) in root/optuna.db and an MLflow run with an artifact in root/mlflow.db."""
    import optuna
    from mlflow.tracking import MlflowClient

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="ui-demo", storage=f"sqlite:///{root / 'optuna.db'}")
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=2)
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.create_experiment("ui-demo", artifact_location=(root / "artifacts" / "ui-demo").as_uri())
    run = client.create_run(exp, run_name="trial-0")
    client.log_metric(run.info.run_id, "val/mrr", 0.25)
    note = root / "note.txt"
    note.write_text("hello from the run")
    client.log_artifact(run.info.run_id, str(note))
    client.set_terminated(run.info.run_id)
    return exp, run.info.run_id


def server_pids(port):
    """Pids of live processes whose command line names `port` (how `ui` passes it to both servers)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(port).encode() in args and state != "Z" and int(cmdline.parent.name) != os.getpid():
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.slow
def test_start_ui_serves_the_run_and_the_study_then_stops(tmp_path):
    exp, run_id = make_stores(tmp_path)
    mlflow_port, dashboard_port = servers.free_port(), servers.free_port()
    handle = servers.start_ui(tmp_path, mlflow_port=mlflow_port, dashboard_port=dashboard_port)
    try:
        assert handle.mlflow_url == f"http://127.0.0.1:{mlflow_port}"
        runs = servers.http_json(handle.mlflow_url + "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp]})
        assert [r["info"]["run_id"] for r in runs["runs"]] == [run_id]
        # Artifacts under STATE/artifacts are served by the UI (file:// root read by the server).
        with urllib.request.urlopen(f"{handle.mlflow_url}/get-artifact?path=note.txt&run_uuid={run_id}") as r:
            assert r.read() == b"hello from the run"
        # MLflow >= 3.5 security middleware: a foreign Host header is refused (DNS-rebinding protection).
        req = urllib.request.Request(handle.mlflow_url + servers.MLFLOW_PROBE, headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 403

        with urllib.request.urlopen(handle.dashboard_url + "/") as r:
            assert r.status == 200
        studies = servers.http_json(handle.dashboard_url + "/api/studies")["study_summaries"]
        assert [s["study_name"] for s in studies] == ["ui-demo"]
        detail = servers.http_json(f"{handle.dashboard_url}/api/studies/{studies[0]['study_id']}")
        assert len(detail["trials"]) == 2
        procs = [s.proc for s in handle.servers]
    finally:
        handle.stop()
    assert all(p.poll() is not None for p in procs)
    assert not any(servers.group_alive(p.pid) for p in procs)  # uvicorn worker included
    assert server_pids(mlflow_port) == [] and server_pids(dashboard_port) == []
    with pytest.raises(OSError):
        urllib.request.urlopen(handle.dashboard_url + "/api/studies", timeout=2)


@pytest.mark.slow
def test_ui_command_on_empty_state_prints_urls_hint_and_stops_on_ctrl_c(tmp_path, serve):
    # The MLflow server is covered above; an http tracking URI (probed and reported, not started: here a stand-in
    # that answers the probe as MLflow does) keeps this test short.
    remote = serve(200, "application/json", b'{"experiments": []}')
    dashboard_port = servers.free_port()
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "latentsweep", "ui", "--state-dir", str(state), "--dashboard-port", str(dashboard_port),
         "--tracking-uri", remote + "/"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("press Ctrl-C"):
                break
        out = "".join(lines)
        assert f"MLflow UI:        {remote}\n" in out, out
        assert f"optuna-dashboard: http://127.0.0.1:{dashboard_port}" in out and cmd_ui.NO_STUDIES_HINT in out
        assert server_pids(dashboard_port) and (state / "optuna.db").exists()
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped" in rest and "Traceback" not in err
    assert server_pids(dashboard_port) == []


def test_port_in_use_fails_at_once_naming_the_server(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(LatentsweepError, match=rf"MLflow UI: port {port} on 127.0.0.1 .*--mlflow-port"):
            servers.start_ui(tmp_path, mlflow_port=port, dashboard_port=servers.free_port())
        with pytest.raises(LatentsweepError, match=rf"optuna-dashboard: port {port} .*--dashboard-port"):
            servers.start_ui(tmp_path, mlflow_port=servers.free_port(), dashboard_port=port)
        assert time.monotonic() - t0 < 5  # checked before anything is spawned
    assert not (tmp_path / "logs").exists()


def test_same_port_for_both_servers_is_refused(tmp_path):
    port = servers.free_port()
    with pytest.raises(LatentsweepError, match="different ports"):
        servers.start_ui(tmp_path, mlflow_port=port, dashboard_port=port)


def test_dashboard_that_dies_is_named_with_its_log_tail(tmp_path, serve):
    # An http tracking URI is an external MLflow server (here a stand-in that answers the probe): only the dashboard
    # is started, and it cannot guess a storage for a journal file that does not exist.
    with pytest.raises(LatentsweepError) as err:
        servers.start_ui(tmp_path, dashboard_port=servers.free_port(), storage=str(tmp_path / "missing.log"),
                         tracking_uri=serve(200, "application/json", b'{"experiments": []}'))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("optuna-dashboard (http://127.0.0.1:") and "failed to start (exit code 1)" in msg
    assert "ValueError: Failed to guess storage class" in msg and "optuna-dashboard-" in msg


def test_new_sqlite_storage_gets_optuna_tables_for_the_dashboard(tmp_path):
    db = tmp_path / "fresh" / "optuna.db"
    servers.ensure_optuna_schema(f"sqlite:///{db}")
    with sqlite3.connect(db) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"version_info", "studies", "trials"} <= tables


def test_mlflow_argv_uses_state_stores_and_allows_a_public_bind_host(tmp_path):
    argv = servers.mlflow_argv("sqlite:///s/mlflow.db", "file:///s/artifacts", "127.0.0.1", 5000, None)
    assert argv[argv.index("--backend-store-uri") + 1] == "sqlite:///s/mlflow.db"
    assert argv[argv.index("--artifacts-destination") + 1] == "file:///s/artifacts"
    assert "--serve-artifacts" in argv and "--allowed-hosts" not in argv
    public = servers.mlflow_argv("sqlite:///m.db", "file:///a", "203.0.113.5", 5000, None)
    assert "203.0.113.5:*" in public[public.index("--allowed-hosts") + 1]
    wildcard = servers.mlflow_argv("sqlite:///m.db", "file:///a", "0.0.0.0", 5000, "mlflow.lan:*")
    assert wildcard[wildcard.index("--allowed-hosts") + 1] == "mlflow.lan:*"


class FakeHandle:
    mlflow_url, dashboard_url = "http://127.0.0.1:1", "http://127.0.0.1:2"
    stopped = False

    def stop(self):
        FakeHandle.stopped = True


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("0.0.0.0", True)])
def test_ui_command_warns_on_non_loopback_host_and_stops_on_interrupt(tmp_path, monkeypatch, capsys, host, warned):
    seen = {}
    monkeypatch.setattr(servers, "start_ui", lambda root, **kw: seen.update(kw, root=root) or FakeHandle())
    monkeypatch.setattr(servers, "http_json", lambda url: {"study_summaries": []})

    def interrupt(handle):
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd_ui, "_serve_until_interrupted", interrupt)
    FakeHandle.stopped = False
    assert main(["ui", "--state-dir", str(tmp_path), "--host", host, "--mlflow-port", "5001"]) == 0
    out, err = capsys.readouterr()
    assert ("no authentication" in err) is warned
    assert "http://127.0.0.1:1" in out and cmd_ui.NO_STUDIES_HINT in out and "stopped" in out
    assert FakeHandle.stopped and seen["host"] == host and seen["mlflow_port"] == 5001
    assert seen["dashboard_port"] == servers.DEFAULT_DASHBOARD_PORT and seen["root"] == tmp_path.resolve()


def test_free_port_is_bindable():
    port = servers.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
