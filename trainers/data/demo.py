"""Where the embedded demo dataset lives (trainers/data/demo_data/, built by search/demodata/build.py): the default data
of
every command, and all the trainer and search/ need of it."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo_data"
SIZE_LIMIT_MB = 20  # committed demo files must stay below this (the package ships them)


def default_train_path() -> Path:
    return DEMO_DIR / "train.npz"


def default_test_path() -> Path:
    return DEMO_DIR / "test.clean.npz"


def default_answers_path() -> Path:
    return DEMO_DIR / "answers.npz"
