"""Benchmark: trials per hour of a small study, 1 worker x 2 threads vs 2 workers x 1 thread, SQLite vs PostgreSQL.

Every trial costs the same (only the learning rate is searched), so the figures compare layouts and storages, not
sampled configurations. Throughput is measured from the first trial's start to the last trial's end as Optuna
recorded them, which leaves out the workers' start-up (imports); wall time with start-up is printed too. The load
average is printed next to each figure because a shared machine's load moves the numbers.

    python benchmarks/workers.py [--trials 6] [--epochs 4] [--hidden 1024] [--pg-admin URL]
    python benchmarks/workers.py --smoke    # 2 trials x 1 epoch per layout on tiny data, SQLite only (tests)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

STUDY = """
[study]
name = "{name}"
n_trials = {n_trials}
sampler = {{ name = "random", seed = 0 }}
pruner = {{ name = "none" }}

[base.data]
val_ratio = 0.2

[base.model]
kind = "mlp"
hidden = [{hidden}]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = {epochs}
batch_size = 256

[space]
"optim.lr" = {{ type = "float", low = 2e-4, high = 3e-3, log = true }}
"""
LAYOUTS = ((1, 2), (2, 1))  # (worker processes, torch threads each): both use the 2 cores of the reference machine
PG_ADMIN = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def data_path(tmp: Path, smoke: bool = False) -> Path:
    from latentsweep.trainers.data.demo import default_train_path
    from latentsweep.trainers.data.synthetic import write_synthetic

    if smoke:
        return write_synthetic(tmp / "syn", 100, dim_text=32, dim_image=48)[0]
    demo = Path(default_train_path())
    if demo.exists():
        return demo
    # Same order of size as the demo data when it is not built: 750 images x 5 captions, MiniLM/EfficientNet dims.
    return write_synthetic(tmp / "syn", 750, dim_text=384, dim_image=1280)[0]


def pg_database(admin_url: str) -> tuple[str | None, str]:
    """A fresh database for the benchmark (URL, name), or (None, reason) when the server is unreachable."""
    import sqlalchemy as sa

    name = f"ls_bench_{uuid.uuid4().hex[:10]}"
    try:
        engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        return None, str(exc).strip().splitlines()[0]
    return admin_url.rsplit("/", 1)[0] + f"/{name}", name


def drop_database(admin_url: str, name: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))


def run_layout(storage: str, workers: int, threads: int, args, tmp: Path, data: Path) -> dict:
    """Create a fresh study, run it with `workers` spawned processes of `threads` threads each, read the timings."""
    import optuna

    from latentsweep.search.process import quiet_optuna
    from latentsweep.search.study.runner import worker_main
    from latentsweep.search.study.storage import StorageSettings
    from latentsweep.search.study.worker import RunSpec, dispose_study, load_or_create
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.search.tracking import make_tracker

    quiet_optuna()
    name = f"bench_{'pg' if storage.startswith('postgresql') else 'sqlite'}_{workers}x{threads}"
    study_file = tmp / f"{name}.toml"
    study_file.write_text(STUDY.format(name=name, n_trials=args.trials, epochs=args.epochs, hidden=args.hidden))
    tracking = f"sqlite:///{tmp / 'mlflow.db'}"
    spec = RunSpec(study_file=str(study_file), name=name, storage=StorageSettings(storage), tracking_uri=tracking,
                   artifact_root=None, state_dir=str(tmp / "state"), data_path=str(data), n_trials=args.trials,
                   timeout=None, threads=threads, progress=False)
    dispose_study(load_or_create(load_study_file(study_file), spec, make_tracker(tracking), create=True))

    load_before = os.getloadavg()
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(spec,)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    wall = time.perf_counter() - start
    load_after = os.getloadavg()

    trials = optuna.load_study(study_name=name, storage=storage).get_trials()
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(done) != args.trials or any(p.exitcode for p in procs):
        raise SystemExit(f"{name}: {len(done)}/{args.trials} trials complete, exit codes {[p.exitcode for p in procs]}")
    span = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
    return {"name": name, "wall": wall, "span": span, "per_hour": len(done) / span * 3600,
            "trial_s": sum(t.duration.total_seconds() for t in done) / len(done),
            "load": (load_before, load_after)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6, help="trials per layout (default 6)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden width (default 1024, as quickstart)")
    parser.add_argument("--pg-admin", default=PG_ADMIN, help="an existing PostgreSQL database to create ours from")
    parser.add_argument("--smoke", action="store_true",
                        help="2 trials x 1 epoch per layout, MLP [16], tiny data, SQLite only: the path in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.trials, args.epochs, args.hidden = 2, 1, 16

    with tempfile.TemporaryDirectory(prefix="ls-bench-workers-") as tmp_name:
        tmp = Path(tmp_name)
        data = data_path(tmp, args.smoke)
        storages = {"sqlite": f"sqlite:///{tmp / 'optuna.db'}"}
        # --smoke stays off the network, loopback included
        pg_url, pg_name = (None, "--smoke") if args.smoke else pg_database(args.pg_admin)
        if pg_url is None:
            print(f"PostgreSQL skipped ({pg_name})")
        else:
            storages["postgresql"] = pg_url
        print(f"study: {args.trials} trials x {args.epochs} epochs, mlp [{args.hidden}], data {data}, "
              f"{os.cpu_count()} CPUs")
        results = {}
        try:
            for label, url in storages.items():
                for workers, threads in LAYOUTS:
                    r = results[label, workers] = run_layout(url, workers, threads, args, tmp, data)
                    (b1, b5, b15), (a1, a5, a15) = r["load"]
                    print(f"{label:>10} {workers} worker(s) x {threads} thread(s): {r['per_hour']:7.0f} trials/h "
                          f"(mean trial {r['trial_s']:.1f} s, span {r['span']:.1f} s, wall with start-up "
                          f"{r['wall']:.1f} s; load avg before {b1:.2f} {b5:.2f} {b15:.2f}, "
                          f"after {a1:.2f} {a5:.2f} {a15:.2f})")
        finally:
            if pg_url is not None:
                drop_database(args.pg_admin, pg_name)
    for label in storages:
        ratio = results[label, 2]["per_hour"] / results[label, 1]["per_hour"]
        print(f"ratio 2x1 / 1x2 on {label}: {ratio:.2f}")
    if "postgresql" in storages:
        for workers, threads in LAYOUTS:
            ratio = results["postgresql", workers]["per_hour"] / results["sqlite", workers]["per_hour"]
            print(f"ratio PostgreSQL / SQLite at {workers}x{threads}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
