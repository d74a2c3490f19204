"""`latentsweep data ...`: `data check` validates a challenge npz and prints a summary; `data holdout` writes a local
leaderboard (an image-disjoint holdout in the challenge format); `data build-demo` rebuilds the demo."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from latentsweep.search.checks import check_new_files, check_outputs, check_seed
from latentsweep.search.cli.demo import add_parser as add_build_demo
from latentsweep.trainers.data.sets import describe_npz, load_answers, load_test, load_train
from latentsweep.search.stores import default_protected
from latentsweep.trainers.data.holdout import HOLDOUT_FILES, write_holdout

# Rows per step when computing norms, so no full-size temporary is made (einsum needs none, slicing keeps it small).
NORM_CHUNK = 8192


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("data", help="check and build data files")
    sub = parser.add_subparsers(dest="data_cmd", metavar="DATA_COMMAND")
    sub.required = True
    check = sub.add_parser("check", help="validate a train / test / answers npz file and print a summary")
    check.add_argument("path", help="train.npz, test.clean.npz or answers.npz")
    check.set_defaults(func=cmd_data_check)
    holdout = sub.add_parser("holdout", help="hold out a fraction of a train file's images (with all their captions) "
                                             "as a local leaderboard: train.npz, test.clean.npz, answers.npz")
    holdout.add_argument("path", help="a labelled train.npz")
    holdout.add_argument("--fraction", type=float, default=0.2, help="fraction of the images held out (default 0.2)")
    holdout.add_argument("--seed", type=int, default=0, help="which images: MD5(seed:name) order (default 0)")
    holdout.add_argument("--out", required=True, help="output directory (created); never the input's own files")
    holdout.add_argument("--force", action="store_true", help="replace holdout files already in --out (never the "
                                                              "input file)")
    holdout.set_defaults(func=cmd_data_holdout)
    add_build_demo(sub)


def _norms(x: np.ndarray) -> np.ndarray:
    out = np.empty(len(x), np.float64)
    for start in range(0, len(x), NORM_CHUNK):
        block = x[start:start + NORM_CHUNK]
        out[start:start + NORM_CHUNK] = np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64))
    return out


def _norm_line(name: str, x: np.ndarray) -> str:
    n = _norms(x)
    return f"{name} norms: mean {n.mean():.3f}, min {n.min():.3f}, max {n.max():.3f}"


def _train_lines(path: str, desc: dict) -> list[str]:
    ts = load_train(path)
    per_image = np.bincount(ts.cap2img, minlength=len(ts.image))
    shape, dtype = desc["keys"].get("captions/label", ((), None))
    label = {"dense": f"dense bool {list(shape)} one-hot (streamed)", "index": f"integer index [{len(ts.cap2img)}]",
             "sparse": "sparse CSR (captions/label_indptr, _indices)"}[desc["label_format"]]
    lines = [f"fingerprint: {ts.fingerprint}",
             f"captions: {len(ts.text)} (text dim {ts.text.shape[1]}), images: {len(ts.image)} "
             f"(image dim {ts.image.shape[1]})",
             f"captions per image: min {per_image.min()}, mean {per_image.mean():.2f}, max {per_image.max()}"
             + (f" ({int((per_image == 0).sum())} images without captions)" if per_image.min() == 0 else ""),
             f"label format: {label}", _norm_line("text", ts.text), _norm_line("image", ts.image)]
    if ts.image_labels is None:
        lines.append("multi-labels: none")
    else:
        names = ts.label_names if ts.label_names is not None else []
        shown = ", ".join(str(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
        lines.append(f"multi-labels: {ts.image_labels.shape[1]} labels, {ts.image_labels.sum(1).mean():.2f} per "
                     f"image on average" + (f" ({shown})" if shown else ""))
    return lines


def _test_lines(path: str) -> list[str]:
    ts = load_test(path)
    return [f"fingerprint: {ts.fingerprint}",
            f"captions: {len(ts.ids)} (text dim {ts.embeddings.shape[1]}), ids {ts.ids.min()}..{ts.ids.max()}",
            _norm_line("text", ts.embeddings)]


def _answers_lines(path: str) -> list[str]:
    ids, image = load_answers(path)
    return [f"captions: {len(ids)}, ids {ids.min()}..{ids.max()}, image dim {image.shape[1]}",
            _norm_line("image", image)]


def cmd_data_holdout(args) -> int:
    check_seed("--seed", args.seed)
    outputs = [Path(args.out).expanduser() / name for name in HOLDOUT_FILES]
    check_outputs("--out", outputs, {"PATH": args.path}, default_protected())
    if not args.force:
        check_new_files("--out", outputs)
    h = write_holdout(load_train(args.path, texts=True), args.fraction, args.seed, args.out)
    print(f"train:   {h.files[0]} ({h.train_images} images, {h.train_captions} captions)")
    print(f"test:    {h.files[1]} ({h.test_captions} captions of {h.test_images} held-out images, "
          f"{h.galleries} galleries)")
    print(f"answers: {h.files[2]}")
    print(f"score a submission: latentsweep submission score SUBMISSION.csv --answers {h.files[2]}")
    return 0


def cmd_data_check(args) -> int:
    desc = describe_npz(args.path)
    kind = desc["kind"]
    body = {"train": lambda: _train_lines(args.path, desc), "test": lambda: _test_lines(args.path),
            "answers": lambda: _answers_lines(args.path)}[kind]()
    size_mb = os.path.getsize(args.path) / 2 ** 20
    print(f"{args.path}: {kind} file, {size_mb:.1f} MB")
    for line in body:
        print(f"  {line}")
    print("ok")
    return 0
