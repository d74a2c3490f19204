"""`latentsweep train` (one run of a study file's base config) and `latentsweep predict` (a submission from a
checkpoint)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from latentsweep.search.checks import check_outputs
from latentsweep.search.stores import add_state_arg, default_protected, protected_paths, state_dir
from latentsweep.search.study.progress import is_terminal
from latentsweep.search.study.studyfile import load_study_file, resolve_data_path
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.config.tree import dump_toml, parse_overrides, with_values
from latentsweep.trainers.data.sets import check_text_dim, load_test, load_train
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.train.loop import resolve_device, train
from latentsweep.trainers.eval.submission import check_submission, write_submission
from latentsweep.trainers.train.tasks import check_split, predict
from latentsweep.trainers.config.validate import validate


# What `train` writes in its --out directory (latentsweep.trainers.train.loop: best.pt;
# latentsweep.trainers.train.records: metrics.csv).
TRAIN_FILES = ("config.toml", "result.json", "best.pt", "metrics.csv")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a study file's base config once")
    p.add_argument("study", help="study TOML file (its [base] table is the config)")
    p.add_argument("--data", help="train npz (default: the study's data.path, else the bundled demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set loss.triplet.margin=0.3 (repeatable)")
    p.add_argument("--epochs", type=int, help="shortcut for --set train.epochs=N")
    p.add_argument("--seed", type=int, help="shortcut for --set train.seed=S")
    p.add_argument("--out", help="output directory (default: STATE_DIR/train/<study>-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_state_arg(p)
    p.set_defaults(func=cmd_train)

    q = sub.add_parser("predict", help="write a validated submission from one checkpoint")
    q.add_argument("checkpoint", help="best.pt written by train or a study trial")
    q.add_argument("--test", required=True, help="test.clean.npz")
    q.add_argument("--out", required=True, help="submission CSV to write")
    q.set_defaults(func=cmd_predict)


def cmd_train(args) -> int:
    """Everything is checked (config, device, data, split, output path) before the output directory is made; a
    failed training removes the directory it made, so an error leaves no partial output."""
    study = load_study_file(args.study)
    values = parse_overrides(args.overrides)
    if args.epochs is not None:
        values["train.epochs"] = args.epochs
    if args.seed is not None:
        values["train.seed"] = args.seed
    cfg = with_values(study.base, values)
    data_path = resolve_data_path(args.data or cfg.data.path)
    cfg = with_values(cfg, {"data.path": str(data_path)})
    validate(cfg)
    resolve_device(cfg.train.device)
    data = load_train(data_path)
    check_split(cfg, data)
    out = (Path(args.out) if args.out
           else state_dir(args.state_dir) / "train" / f"{study.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise LatentsweepError(f"--out {out}: exists and is not a directory")
    check_outputs("--out", [out / name for name in TRAIN_FILES], {"STUDY": args.study, "--data": data_path},
                  protected_paths(state_dir(args.state_dir, create=False)))
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_write(out / "config.toml") as fh:
            fh.write(dump_toml(cfg))
        result = train(cfg, data, out_dir=out, progress=not args.quiet and is_terminal())
        summary = {"best_epoch": result.best_epoch, **result.best_metrics, "checkpoint": str(result.checkpoint),
                   "out": str(out)}
        with atomic_write(out / "result.json") as fh:
            fh.write(json.dumps(summary, indent=2))
    except Exception:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise
    print(json.dumps(summary))
    return 0


def cmd_predict(args) -> int:
    check_outputs("--out", [args.out], {"CHECKPOINT": args.checkpoint, "--test": args.test}, default_protected())
    model, cfg, _ = load_model(args.checkpoint)
    test = load_test(args.test)
    check_text_dim(test, model.text_mean.shape[0])
    pred = predict(model, torch.as_tensor(test.embeddings)).numpy()
    write_submission(args.out, test.ids, pred)
    check_submission(args.out, test, dim=pred.shape[1])
    print(f"wrote {args.out}: {len(test.ids)} rows, dim {pred.shape[1]}")
    return 0
