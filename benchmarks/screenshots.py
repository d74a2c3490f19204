"""Screenshots of both UIs after a warm-started study: MLflow's experiments, trials view, a trial's and the parent
run's pages, and optuna-dashboard's study.

    python benchmarks/screenshots.py [--state-dir DIR] [--study quickstart] [--out DIR] [--docs]

Without finished studies in --state-dir, runs studies/STUDY.toml there twice: STUDY, then STUDY-2 on the same data,
which warm-starts from it (about 20 minutes on 2 loaded cores). Starts `latentsweep ui` on free ports, drives headless
Chromium (`apt-get install -y chromium`) over its DevTools pipe, stops the UI (SIGTERM: it stops both servers) and
prints the PNG paths. The pages shown are STUDY-2's: its warm-started trial (else its best) and its parent run.
--docs writes 256-colour PNGs, small enough for docs/img/.

    python benchmarks/screenshots.py --smoke    # tests: everything before the servers and Chromium

--smoke runs both studies for 1 trial each on tiny synthetic data in a temp dir and resolves the pages' ids
(experiment, trial and parent runs, Optuna study) from their state; it starts no server and no browser, and prints
the URL paths it would shoot.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH, HEIGHT = 1600, 1000
# MLflow 3 keeps a GenAI/"Model training" switch per browser (localStorage, GenAI by default); this URL parameter
# selects the classic ML pages (Training runs, Model metrics) that a study's runs belong to.
ML_MODE = "workflowType=machine_learning"
# MLflow 3.17 opens its Assistant panel over a third of the page on a browser's first visit, once (the flag it then
# stores, under its storage helper's "<key>_v<version>" name): every screenshot is a first visit, a user's is not.
NO_FIRST_VISIT = 'try { localStorage.setItem("mlflow.assistant.fab.autoOpenedOnFirstLoad_v1", "true") } catch (e) {}'
# MLflow and optuna-dashboard draw after the first paint (runs fetched, charts lazy-loaded): a page is shot once two
# captures SETTLE_S apart are identical, or after PAGE_MAX_S (a loaded 2-core machine took up to 10 s per page).
SETTLE_S = 2.0
PAGE_MAX_S = 120.0
CDP_TIMEOUT_S = 60.0
UI_START_S = 180  # `latentsweep ui` waits up to 120 s for both servers; a loaded machine gets some more


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "latentsweep", *args]


def ensure_studies(state: Path, study: str, run_args: tuple[str, ...] = ()) -> str:
    """Run STUDY and then STUDY-2 (warm-started from it) into `state` unless they are there; the second's name."""
    listed = ""
    if (state / "optuna.db").is_file():
        listed = subprocess.run(cli("study", "list", "--state-dir", str(state), "--csv"), capture_output=True,
                                text=True, cwd=ROOT, check=True).stdout
    names = {line.split(",")[0] for line in listed.splitlines()[1:]}
    for name in (study, f"{study}-2"):
        if name not in names:
            print(f"running studies/{study}.toml as '{name}' into {state} ...", flush=True)
            subprocess.run(cli("study", "run", f"studies/{study}.toml", "--name", name, "--state-dir", str(state),
                               "--quiet", *run_args), cwd=ROOT, check=True)
    return f"{study}-2"


def targets(state: Path, study: str) -> dict[str, str]:
    """The pages' ids: MLflow experiment, the shown trial's run and the parent run, and the Optuna study id."""
    import optuna
    from mlflow import MlflowClient

    from latentsweep.search.study.contract import WARM_ATTR, StudyRecord, TrialOutputs, read_trials
    from latentsweep.search.tracking.paths import relocate_mlflow

    relocate_mlflow(state)
    storage = optuna.storages.RDBStorage(f"sqlite:///{state / 'optuna.db'}")
    loaded = optuna.load_study(study_name=study, storage=storage)
    done = read_trials(loaded, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))
    shown = next((t for t in done if WARM_ATTR in t.user_attrs), loaded.best_trial)
    exp = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_experiment_by_name(study)
    return {"exp": exp.experiment_id, "run": TrialOutputs.from_attrs(shown.user_attrs).mlflow_run_id,
            "parent": StudyRecord.of(loaded).parent_run_id, "study": str(storage.get_study_id_from_name(study))}


def pages(ids: dict[str, str]) -> dict[str, str]:
    """{png name: URL path and query} of every picture, relative to its server (MLflow, or the dashboard's)."""
    runs = f"/#/experiments/{ids['exp']}/runs"
    return {"mlflow_experiments.png": f"/#/experiments?{ML_MODE}",
            "mlflow_trials.png": f"{runs}?viewStateShareKey=trials&{ML_MODE}",  # the trials view (tracking/base.py)
            "mlflow_trial.png": f"{runs}/{ids['run']}?{ML_MODE}",
            "mlflow_trial_metrics.png": f"{runs}/{ids['run']}/model-metrics?{ML_MODE}",
            "mlflow_trial_ranks.png": f"{runs}/{ids['run']}/artifacts/rank_distribution.png?{ML_MODE}",
            "mlflow_parent.png": f"{runs}/{ids['parent']}?{ML_MODE}",
            "mlflow_parent_history.png": f"{runs}/{ids['parent']}/artifacts/plots/optimization_history.png?{ML_MODE}",
            "optuna_dashboard_study.png": f"/dashboard/studies/{ids['study']}"}


def smoke() -> int:
    """Everything before the servers and the browser, on 1-trial studies of tiny data in a temp dir."""
    from latentsweep.trainers.data.synthetic import write_synthetic

    with tempfile.TemporaryDirectory(prefix="screenshots-smoke-") as tmp:
        data = write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0]
        state = Path(tmp) / "state"
        second = ensure_studies(state, "quickstart", ("--data", str(data), "--n-trials", "1"))
        for name, path in pages(targets(state, second)).items():
            print(f"{name}  <-  {path}")
    print("smoke: no server or Chromium started (the studies, their ids and the URLs are what was checked)")
    return 0


class Browser:
    """Headless Chromium driven over its DevTools pipe (fd 3 in, fd 4 out, NUL-separated JSON): one page, a fixed
    viewport, real time to render (--virtual-time-budget ran ahead of MLflow's lazily loaded charts: empty frames)."""

    def __init__(self, exe: str):
        self.profile = tempfile.TemporaryDirectory(prefix="chromium-")
        argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
                f"--user-data-dir={self.profile.name}", "about:blank"]
        self.proc = subprocess.Popen(["sh", "-c", 'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null 2>/dev/null',
                                      *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buffer, self.last_id, self.session = b"", 0, None
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1,
                                                         "mobile": False})
        self.call("Page.addScriptToEvaluateOnNewDocument", {"source": NO_FIRST_VISIT})

    def call(self, method: str, params: dict | None = None) -> dict:
        """Send one command (to the page once attached) and return its result; events in between are skipped."""
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params or {},
                   **({"sessionId": self.session} if self.session else {})}
        self.proc.stdin.write(json.dumps(message).encode() + b"\0")
        self.proc.stdin.flush()
        deadline = time.monotonic() + CDP_TIMEOUT_S
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.last_id:
                    if "error" in reply:
                        raise RuntimeError(f"Chromium: {method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method} in {CDP_TIMEOUT_S:.0f} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.proc.wait()})")
            self.buffer += chunk

    def shoot(self, url: str, out: Path, docs: bool) -> None:
        """Open `url`, wait until two captures agree (or PAGE_MAX_S), write the last one."""
        self.call("Page.navigate", {"url": url})
        started, last = time.monotonic(), None
        while True:
            time.sleep(SETTLE_S)
            png = self.call("Page.captureScreenshot", {"format": "png"})["data"]
            if png == last or time.monotonic() - started > PAGE_MAX_S:
                break
            last = png
        out.write_bytes(base64.b64decode(png))
        if docs:
            shrink(out)
        print(f"{out}  <-  {url}  ({time.monotonic() - started:.0f} s, {out.stat().st_size // 1024} KB)", flush=True)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            self.proc.kill()
        self.proc.wait(timeout=60)
        self.profile.cleanup()


def shrink(png: Path) -> None:
    """256 colours (flat UI colours and anti-aliased text survive it): about a third of the bytes."""
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(png, optimize=True)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=os.path.join(tempfile.gettempdir(), "latentsweep-screens"))
    parser.add_argument("--study", default="quickstart", help="bundled study run twice (STUDY, STUDY-2)")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "latentsweep-screens", "png"))
    parser.add_argument("--docs", action="store_true", help="256-colour PNGs (docs/img/)")
    parser.add_argument("--smoke", action="store_true",
                        help="1-trial studies on tiny data in a temp dir and the pages' URLs; no server, no browser")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        raise SystemExit("no Chromium found: apt-get install -y chromium")
    from latentsweep.search.ui.servers import free_port  # here, not at the top: --help answers without MLflow's imports

    state, out = Path(args.state_dir).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ids = targets(state, ensure_studies(state, args.study))
    mlflow_port, dash_port = free_port(), free_port()
    while dash_port == mlflow_port:
        dash_port = free_port()
    proc = start_ui(state, mlflow_port, dash_port)
    try:
        browser = Browser(exe)
        try:
            mlflow, dash = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{dash_port}"
            for name, path in pages(ids).items():
                browser.shoot(f"{dash if name.startswith('optuna') else mlflow}{path}", out / name, args.docs)
        finally:
            browser.close()
    finally:
        stop_ui(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
