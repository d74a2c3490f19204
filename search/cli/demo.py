"""The `latentsweep data build-demo` sub-command: rebuild the embedded Tux Paint demo dataset."""
from __future__ import annotations

import argparse
from pathlib import Path

from latentsweep.search.demodata import build as demo
from latentsweep.trainers.data.demo import DEMO_DIR
from latentsweep.trainers.core.errors import LatentsweepError


def add_parser(data_subparsers) -> argparse.ArgumentParser:
    """Add `build-demo` to the sub-parsers of `latentsweep data` (called by search/cli/data.py)."""
    p = data_subparsers.add_parser(
        "build-demo",
        help="rebuild the demo dataset from Debian's Tux Paint stamps (needs apt-get, dpkg-deb and the demo extras)",
        description="Download tuxpaint-stamps-default with apt-get, render every stamp, encode images with "
                    "EfficientNet-Lite0 and captions with multilingual-e5-small, and write train.npz, "
                    "test.clean.npz, answers.npz and CARD.md. Needs: " + demo.INSTALL_HINT,
    )
    p.add_argument("--out", type=Path, default=DEMO_DIR, help="output directory (default: the packaged demo)")
    p.add_argument("--work", type=Path, default=None,
                   help="work directory for the .deb, unpacked stamps and cached encodings "
                        "(default: ~/.cache/latentsweep/demo-build); reused when present")
    p.add_argument("--languages", default=",".join(demo.DEFAULT_LANGUAGES),
                   help="comma-separated caption languages, 'en' = the English line (default: %(default)s)")
    p.add_argument("--min-captions", type=int, default=demo.MIN_CAPTIONS,
                   help="skip stamps with fewer captions than this (default: %(default)s)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of images held out as test, rounded to a multiple of 100 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, caption choice and id order")
    p.add_argument("--device", default=None, help="torch device of the image encoder (default: cuda if available)")
    p.set_defaults(func=cmd_data_build_demo)
    return p


def cmd_data_build_demo(args) -> int:
    languages = [code.strip() for code in args.languages.split(",") if code.strip()]
    if not languages:
        raise LatentsweepError("--languages: give at least one language code, e.g. en,fr,de,es,it")
    facts = demo.build_demo(args.out, args.work or demo.default_work_dir(), languages=languages,
                            test_fraction=args.test_fraction, seed=args.seed, min_captions=args.min_captions,
                            device=args.device)
    r = facts["ridge"]
    print(f"wrote {args.out}: {facts['n_train_images']} train images / {facts['n_train_captions']} captions, "
          f"{facts['n_test']} test captions, {sum(facts['sizes'].values()) / 1e6:.1f} MB, "
          f"ridge test MRR {r['mrr']:.3f} (R@10 {r['r10']:.3f}), {facts['build_seconds'] / 60:.1f} min")
    return 0
