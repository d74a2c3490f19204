"""The platform against a careful hand-written script, end to end on one dataset, scored through its answer key.

Each run, in a fresh state directory: `latentsweep study run STUDY --timeout T_STUDY`, then `latentsweep pick` with
its defaults (its default budget; `--pick-seconds` passes --budget instead); next to it the reference script
(benchmarks/reference_script.py: one MLP, multi-positive InfoNCE, all images, 3 seeds). Rows per run:
  * platform: the submission of study + pick (out-of-fold selection, fold models bagged with refits on every image);
  * reference: the hand-written script;
  * best single refit: the pick's best single member alone, its submission models (fold models and refits) averaged;
  * no refit: the same selection made from the trials' checkpoints (`pick --no-refit`; the fold jobs are reused).
Runs differ by the study's sampler seed. Prints a markdown table (mean and spread over runs) and writes JSON.

    python benchmarks/end_to_end.py [--runs 2] [--study-seconds 600] [--pick-seconds S] [--study studies/full.toml]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search.pick import ensemble  # noqa: E402
from trainers.checkpoint import load_model  # noqa: E402
from trainers.data import load_test  # noqa: E402
from trainers.demo import default_answers_path, default_test_path, default_train_path  # noqa: E402
from trainers.submission import score_submission, write_submission  # noqa: E402
from trainers.tasks import predict  # noqa: E402

CLI = [sys.executable, "-m", "search"]


def sh(argv: list[str], log: Path) -> float:
    """Run a command with its output appended to `log`; returns its wall time; raises on a non-zero exit."""
    start = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(argv)}\n")
        fh.flush()
        subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return time.monotonic() - start


def seeded_study(study: Path, seed: int, out: Path) -> Path:
    """A copy of the study file whose sampler seed is `seed` (the runs must not replay one another), with its sibling
    study files beside it (enqueued recipes are found relative to the file)."""
    for sibling in study.parent.glob("*.toml"):
        (out.parent / sibling.name).write_text(sibling.read_text())
    text = study.read_text()
    text, n = re.subn(r"(sampler\s*=\s*\{[^}]*seed\s*=\s*)\d+", rf"\g<1>{seed}", text, count=1)
    if n != 1:
        raise SystemExit(f"{study}: no sampler seed to vary")
    out.write_text(text)
    return out


def members_submission(manifest: dict, member: str, test, out: Path) -> Path:
    """The submission of one member's refit models (its seeds averaged), from the pick's manifest."""
    ckpts = [m["checkpoint"] for m in manifest["submission_models"] if m["member"] == member]
    import torch

    x = torch.as_tensor(test.embeddings)
    preds = [predict(load_model(c)[0], x).numpy() for c in ckpts]
    write_submission(out, test.ids, ensemble.combine(preds, np.full(len(preds), 1 / len(preds))))
    return out


def one_run(seed: int, args, work: Path) -> dict:
    log = work / "log.txt"
    state = work / "state"
    study_file = seeded_study(args.study, seed, work / args.study.name)
    name = re.search(r'name\s*=\s*"([^"]+)"', study_file.read_text()).group(1)
    row: dict = {"seed": seed}
    if args.reuse and (state / "optuna.db").is_file():  # re-pick a finished run's study (e.g. after a picker change)
        row["study_s"] = None
    else:
        row["study_s"] = sh([*CLI, "study", "run", str(study_file), "--state-dir", str(state), "--timeout",
                             str(args.study_seconds), "--quiet", "--data", str(args.data)], log)
    budget = [] if args.pick_seconds is None else ["--budget", str(args.pick_seconds)]
    row["pick_s"] = sh([*CLI, "pick", name, "--state-dir", str(state), *budget,
                        "--test", str(args.test), "--out", str(work / "platform.csv"), "--quiet"], log)
    manifest = json.loads((work / "platform.manifest.json").read_text())
    row["pick_budget_s"] = manifest["options"]["budget"]
    sh([*CLI, "pick", name, "--state-dir", str(state), "--no-refit", *budget,
        "--test", str(args.test), "--out", str(work / "norefit.csv"), "--quiet"], log)
    test = load_test(args.test)
    members_submission(manifest, manifest["best_single"], test, work / "single.csv")
    if args.reuse and (work / "reference.csv").is_file():
        row["reference_s"] = None
    else:
        row["reference_s"] = sh([sys.executable, str(ROOT / "benchmarks" / "reference_script.py"), str(args.data),
                                 str(args.test), str(work / "reference.csv")], log)
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")
    row["trials"] = {s.name: sum(t.state == s for t in study.trials) for s in TrialState if s.is_finished()}
    for key in ("platform", "reference", "single", "norefit"):
        row[key] = score_submission(work / f"{key}.csv", args.answers)["mrr"]
    row["members"] = manifest["weights"]
    row["nested_gain"] = [manifest.get("gain_mrr"), manifest.get("gain_mrr_std")]
    return row


def table(rows: list[dict]) -> str:
    labels = {"platform": "study + pick (oof selection, refit)", "reference": "reference script",
              "single": "best single member, refit", "norefit": "study + pick --no-refit"}
    lines = ["| submission | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " | mean | spread |",
             "|---|" + "---|" * (len(rows) + 2)]
    for key, label in labels.items():
        values = np.array([r[key] for r in rows])
        lines.append(f"| {label} | " + " | ".join(f"{v:.4f}" for v in values)
                     + f" | {values.mean():.4f} | {values.max() - values.min():.4f} |")
    diff = np.array([r["platform"] - r["reference"] for r in rows])
    lines.append(f"| platform - reference | " + " | ".join(f"{v:+.4f}" for v in diff)
                 + f" | {diff.mean():+.4f} | {diff.max() - diff.min():.4f} |")
    gap = np.array([r["platform"] - r["single"] for r in rows])
    lines.append(f"| platform - best single refit | " + " | ".join(f"{v:+.4f}" for v in gap)
                 + f" | {gap.mean():+.4f} | {gap.max() - gap.min():.4f} |")
    timed = [r for r in rows if r.get("study_s") and r.get("reference_s")]
    for key, label in (("study_s", "study wall time (s)"), ("pick_s", "pick wall time (s), default budget"),
                       ("reference_s", "reference script wall time (s)")):
        values = np.array([r[key] for r in timed])
        if len(values):
            lines.append(f"| {label} | " + " | ".join(f"{v:.0f}" for v in values) + f" | {values.mean():.0f} | |")
    ratio = np.array([(r["study_s"] + r["pick_s"]) / r["reference_s"] for r in timed])
    if len(ratio):
        lines.append("| platform time / reference time | " + " | ".join(f"{v:.1f}x" for v in ratio)
                     + f" | {ratio.mean():.1f}x | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "full.toml")
    p.add_argument("--study-seconds", type=float, default=600)
    p.add_argument("--pick-seconds", type=float, default=None, help="pick --budget (default: the pick's default)")
    p.add_argument("--data", type=Path, default=default_train_path())
    p.add_argument("--test", type=Path, default=default_test_path())
    p.add_argument("--answers", type=Path, default=default_answers_path())
    p.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--runs-from", type=int, default=1, help="number of the first run (its sampler seed is one less)")
    p.add_argument("--reuse", action="store_true",
                   help="keep a run's finished study and reference submission; redo the picks")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="latentsweep-e2e-"))
    rows = []
    for i in range(args.runs_from - 1, args.runs_from - 1 + args.runs):
        run_dir = work / f"run-{i + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        rows.append(one_run(i, args, run_dir))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
