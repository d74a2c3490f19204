"""`latentsweep pick STUDY`: ensemble a study's best trials, scored honestly, into a submission and an MLflow model."""
from __future__ import annotations


from latentsweep.search.pick.ensemble import METHODS
from latentsweep.search.pick.options import FALLBACKS, SELECTIONS, parse_budget
from latentsweep.search.pick.picker import PickOptions, run_pick
from latentsweep.search.pick.selection import WHERE, spread_text
from latentsweep.search.stores import add_state_arg, safe_name
from latentsweep.search.study.progress import is_terminal


def add_parser(sub) -> None:
    p = sub.add_parser("pick", help="ensemble a study's best trials into a submission (out-of-fold selection, "
                                    "refit on every labelled image)")
    p.add_argument("study", help="study name")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite under the state directory)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the state directory)")
    p.add_argument("--top", type=int, default=PickOptions.top,
                   help=f"candidates: the 2K best trials (complete or pruned; default K={PickOptions.top}); val "
                        "selection chooses among all of them, oof keeps K ordered for diversity by a greedy ensemble "
                        "on the study's val split")
    p.add_argument("--method", choices=METHODS, default=PickOptions.method,
                   help="greedy: Caruana forward selection with replacement; mean: uniform; weighted: weights "
                        "proportional to each member's select-half MRR (default greedy)")
    p.add_argument("--size", type=int, default=PickOptions.size, help="greedy: at most this many picks (default 10)")
    p.add_argument("--selection", choices=SELECTIONS, default=PickOptions.selection,
                   help="val (default): choose on the trials' own checkpoints' predictions of the study's val split "
                        "(no training), the gain cross-fitted over folds of its images, and spend the budget on "
                        "refits; oof: retrain each candidate on k-1 image folds and choose on out-of-fold "
                        "predictions of every labelled image (fold models bagged into the submission; for trials "
                        "that do not share a val split); halves: choose on one half of the val split, report on the "
                        "other")
    p.add_argument("--folds", type=int, default=PickOptions.folds, help="oof: number of image folds (default 5)")
    p.add_argument("--fallback", choices=FALLBACKS, default=PickOptions.fallback,
                   help="val and oof: submit the best single member instead of the ensemble when the ensemble's "
                        "cross-fitted gain is not above its standard error (one-se), or never "
                        f"(default {PickOptions.fallback})")
    p.add_argument("--no-refit", dest="refit", action="store_false",
                   help="make the submission from the trials' checkpoints instead of refitting the chosen members "
                        "on every labelled image")
    p.add_argument("--seeds", type=int, default=None,
                   help="refit: seeds per chosen member (default 3); with --no-refit --selection halves: retrain "
                        "the best min(K, 3) configs with this many more seeds as extra candidates (default 0)")
    p.add_argument("--budget", default="auto", metavar="SECONDS|auto|none",
                   help="time bound for the whole pick: folds, candidates and seeds are planned to fit, the plan and "
                        "its estimate are printed before any training, and no job starts once it is spent (default "
                        "auto: half the study's wall time, within 60-600 s; none: no bound); finished jobs are "
                        "reused and cost nothing")
    p.add_argument("--data", help="train npz (default: the path recorded on the trials, else the demo data)")
    p.add_argument("--test", help="test.clean.npz (default: the demo test for the demo data, else the one beside "
                                  "--data)")
    p.add_argument("--out", help="submission CSV (default: STATE_DIR/picks/<study>/submission.csv); the manifest "
                                 "(<name>.manifest.json) and report table (<name>.report.csv) go beside it")
    p.add_argument("--register", metavar="NAME", help="register the ensemble in the MLflow Model Registry as NAME")
    p.add_argument("--seed", type=int, default=PickOptions.seed,
                   help="seed of the leaderboard galleries' shuffle (default 0)")
    p.add_argument("--device", default=PickOptions.device, help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_state_arg(p)
    p.set_defaults(func=cmd_pick)


def cmd_pick(args) -> int:
    safe_name(args.study)  # STATE/picks/<study> is built from it
    opts = PickOptions(study=args.study, state_dir=args.state_dir, storage=args.storage,
                       tracking_uri=args.tracking_uri, top=args.top, method=args.method, size=args.size,
                       seeds=args.seeds, selection=args.selection, folds=args.folds, fallback=args.fallback,
                       refit=args.refit,
                       budget=parse_budget(args.budget), data=args.data, test=args.test, out=args.out,
                       register=args.register,
                       seed=args.seed, device=args.device, progress=not args.quiet and is_terminal())
    print_result(run_pick(opts))
    return 0


def print_result(result) -> None:
    """The pick's report table, its gain and where everything went, on stdout."""
    table = result.table.copy()
    table["weight"] = table["weight"].map(lambda w: "" if w is None or w != w else f"{w:.3f}")
    print(table.to_string(index=False, na_rep="", float_format=lambda v: f"{v:.4f}"))
    where = WHERE.get(result.selection)
    if where:
        print(f"gain ensemble - best single ({where}): {result.gain:+.4f}{spread_text(result.gain_se)} MRR")
    print(f"submission: {result.submission}\nmanifest:   {result.manifest}\nreport:     {result.report}")
    if result.run_id is None:
        print("MLflow: not written (see the warning above); the submission, manifest and report are in place")
        return
    print(f"MLflow run {result.run_id}; pyfunc model {result.model_uri or 'not logged (the budget, said above)'}"
          + (f"; registered {result.registered['name']} v{result.registered['version']}" if result.registered
             else ""))
