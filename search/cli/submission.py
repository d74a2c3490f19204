"""`latentsweep submission check|score`: validate a submission CSV against a test set, or score it with answers."""
from __future__ import annotations

import json

from latentsweep.trainers.data.sets import load_test
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, METRIC_KEYS
from latentsweep.trainers.eval.submission import check_submission, score_submission


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("submission", help="check or score a submission CSV")
    sub = p.add_subparsers(dest="submission_cmd", required=True, metavar="ACTION")

    check = sub.add_parser("check", help="every test id once, one dimension, finite values")
    check.add_argument("file", help="submission CSV (id,embedding)")
    check.add_argument("--test", required=True, help="test.clean.npz the submission answers")
    check.add_argument("--dim", type=int, default=None, help="expected embedding dimension (e.g. 1536)")
    check.set_defaults(func=cmd_submission_check)

    score = sub.add_parser("score", help="leaderboard metrics against an answer key (chunks of 100 by caption id)")
    score.add_argument("file", help="submission CSV (id,embedding)")
    score.add_argument("--answers", required=True, help="answers.npz (captions/ids, images/embeddings)")
    score.add_argument("--gallery-size", type=int, default=GALLERY_SIZE, help="captions per gallery chunk")
    score.set_defaults(func=cmd_submission_score)


def cmd_submission_check(args) -> int:
    n, dim = check_submission(args.file, load_test(args.test), dim=args.dim)
    print(f"ok: {n} rows, dim {dim}")
    return 0


def cmd_submission_score(args) -> int:
    metrics = score_submission(args.file, args.answers, gallery_size=args.gallery_size)
    width = max(len(k) for k in METRIC_KEYS)
    for key in METRIC_KEYS:
        print(f"{key:<{width}}  {metrics[key]:.4f}")
    print(json.dumps({"mrr": metrics["mrr"]}))
    return 0
