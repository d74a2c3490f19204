"""Screenshots of both UIs on a finished study: MLflow runs table, a trial's metric chart, optuna-dashboard's study.

    python benchmarks/screenshots.py [--state-dir DIR] [--study quickstart] [--out DIR]

Without a finished study in --state-dir, runs studies/quickstart.toml there first (a few minutes on 2 cores). Starts
`latentsweep ui` on free ports, takes the pictures with headless Chromium (`apt-get install -y chromium`), stops the
UI (SIGTERM: it stops both servers) and prints the PNG paths.

    python benchmarks/screenshots.py --smoke    # tests: everything before the servers and Chromium

--smoke runs studies/quickstart.toml for 1 trial on tiny synthetic data in a temp dir and resolves the pages' ids
(experiment, best trial's run, Optuna study) from its state; it starts no server and no browser, and prints the URL
paths it would shoot.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOW = "1920,1080"
# MLflow 3 keeps a GenAI/"Model training" switch per browser (localStorage, GenAI by default); this URL parameter
# selects the classic ML pages (Training runs, Model metrics) that a study's runs belong to.
ML_MODE = "workflowType=machine_learning"
TRIALS_FILTER = urllib.parse.quote("tags.`latentsweep.role` = 'trial'")
# MLflow's UI is a JavaScript app that fetches runs after the first paint: give it virtual time to render.
VIRTUAL_TIME_MS = 30000  # 15 s left the metric charts spinning on a loaded 2-core machine
UI_START_S = 180  # `latentsweep ui` waits up to 120 s for both servers; a loaded machine gets some more


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "latentsweep", *args]


def ensure_study(state: Path, study: str, run_args: tuple[str, ...] = ()) -> None:
    if (state / "optuna.db").is_file():
        listed = subprocess.run(cli("study", "list", "--state-dir", str(state), "--csv"), capture_output=True,
                                text=True, cwd=ROOT, check=True).stdout
        if any(line.split(",")[0] == study for line in listed.splitlines()[1:]):
            return
    print(f"running studies/{study}.toml into {state} ...", flush=True)
    subprocess.run(cli("study", "run", f"studies/{study}.toml", "--state-dir", str(state), "--quiet", *run_args),
                   cwd=ROOT, check=True)


def targets(state: Path, study: str) -> tuple[str, str, int]:
    """(experiment id, run id of the best trial, Optuna study id)."""
    import optuna
    from mlflow import MlflowClient

    from latentsweep.search.tracking.paths import relocate_mlflow

    relocate_mlflow(state)
    storage = optuna.storages.RDBStorage(f"sqlite:///{state / 'optuna.db'}")
    loaded = optuna.load_study(study_name=study, storage=storage)
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name(study)
    return exp.experiment_id, loaded.best_trial.user_attrs["mlflow_run_id"], storage.get_study_id_from_name(study)


def start_ui(state: Path, mlflow_port: int, dash_port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cli("ui", "--state-dir", str(state), "--mlflow-port", str(mlflow_port),
                                "--dashboard-port", str(dash_port)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + UI_START_S
    for line in proc.stdout:
        print(f"  ui: {line.rstrip()}", flush=True)
        if "press Ctrl-C" in line:
            return proc
        if time.monotonic() > deadline:
            break
    stop_ui(proc)
    raise SystemExit("latentsweep ui did not start")


def stop_ui(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if proc.stdout:
        for line in proc.stdout:
            print(f"  ui: {line.rstrip()}", flush=True)


def pages(exp_id: str, run_id: str, study_id: int) -> dict[str, str]:
    """{png name: URL path and query} of every picture, relative to its server (MLflow, or the dashboard's)."""
    runs = f"/#/experiments/{exp_id}/runs"
    return {"mlflow_runs_table.png": f"{runs}?{ML_MODE}&searchFilter={TRIALS_FILTER}"
                                     "&orderByKey=metrics.%60best%2Fval%2Fmrr%60&orderByAsc=false",
            "mlflow_trial_metrics.png": f"{runs}/{run_id}/model-metrics?{ML_MODE}",
            "mlflow_trial_overview.png": f"{runs}/{run_id}?{ML_MODE}",
            "optuna_dashboard_study.png": f"/dashboard/studies/{study_id}"}


def smoke() -> int:
    """Everything before the servers and the browser, on a 1-trial quickstart study of tiny data in a temp dir."""
    from latentsweep.trainers.data.synthetic import write_synthetic

    with tempfile.TemporaryDirectory(prefix="screenshots-smoke-") as tmp:
        data = write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0]
        state = Path(tmp) / "state"
        ensure_study(state, "quickstart", ("--data", str(data), "--n-trials", "1"))
        for name, path in pages(*targets(state, "quickstart")).items():
            print(f"{name}  <-  {path}")
    print("smoke: no server or Chromium started (the study, its ids and the URLs are what was checked)")
    return 0


def shoot(browser: str, url: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={WINDOW}",
                        f"--virtual-time-budget={VIRTUAL_TIME_MS}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=180)
    print(f"{out}  <-  {url}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=os.path.join(tempfile.gettempdir(), "latentsweep-screens"))
    parser.add_argument("--study", default="quickstart")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "latentsweep-screens", "png"))
    parser.add_argument("--smoke", action="store_true",
                        help="a 1-trial study on tiny data in a temp dir and the pages' URLs; no server, no browser")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium found: apt-get install -y chromium")
    from latentsweep.search.ui.servers import free_port  # here, not at the top: --help answers without MLflow's imports

    state, out = Path(args.state_dir).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ensure_study(state, args.study)
    exp_id, run_id, study_id = targets(state, args.study)
    mlflow_port, dash_port = free_port(), free_port()
    while dash_port == mlflow_port:
        dash_port = free_port()
    proc = start_ui(state, mlflow_port, dash_port)
    try:
        mlflow, dash = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{dash_port}"
        for name, path in pages(exp_id, run_id, study_id).items():
            shoot(browser, f"{dash if name.startswith('optuna') else mlflow}{path}", out / name)
    finally:
        stop_ui(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
