"""`latentsweep data holdout`: an image-disjoint local leaderboard in the challenge format, scored like the real one."""
from __future__ import annotations

import numpy as np
import pytest

from latentsweep.search.cli.main import main
from latentsweep.trainers.data.sets import load_answers, load_test, load_train
from latentsweep.trainers.eval.metrics import GALLERY_SIZE
from latentsweep.trainers.eval.submission import score_submission, write_submission
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A train file of 450 images with 1-4 captions each (uneven, so the gallery order has work to do)."""
    root = tmp_path_factory.mktemp("holdout")
    train, _, _ = write_synthetic(root / "src", 450, dim_text=16, dim_image=24, n_test=10)
    return load_train(train), root


def test_holdout_is_image_disjoint_keeps_every_caption_and_galleries_hold_distinct_images(source):
    data, root = source
    out = root / "h0"
    assert main(["data", "holdout", data.path, "--fraction", "0.3", "--seed", "4", "--out", str(out)]) == 0
    train, test = load_train(out / "train.npz"), load_test(out / "test.clean.npz")
    ids, truth = load_answers(out / "answers.npz")
    answer_names = np.load(out / "answers.npz")["images/names"]
    held = set(answer_names)
    assert not held & set(train.image_names)  # image-disjoint
    assert len(held) == round(0.3 * len(data.image_names)) or len(held) < round(0.3 * len(data.image_names))
    assert set(train.image_names) | held <= set(data.image_names)
    # every caption of a held-out image is a test caption, every other caption stays in train with its id
    name_of = dict(zip(range(len(data.image_names)), data.image_names))
    held_caps = [i for i, img in enumerate(data.cap2img) if name_of[int(img)] in held]
    assert len(test.ids) == len(held_caps) and len(train.cap2img) + len(held_caps) == len(data.cap2img)
    assert set(train.caption_ids) == set(data.caption_ids) - set(data.caption_ids[held_caps])
    # test rows carry the held captions' embeddings and the answer key their true images
    by_text = {t.tobytes(): int(data.cap2img[i]) for i, t in zip(held_caps, data.text[held_caps])}
    img_rows = {n: data.image[i] for i, n in enumerate(data.image_names)}
    for row, emb, name, img in zip(ids, test.embeddings, answer_names, truth):
        assert name_of[by_text[emb.tobytes()]] == name and np.array_equal(img, img_rows[name])
    # each consecutive chunk of GALLERY_SIZE captions (the leaderboard's galleries) holds distinct images
    order = np.argsort(ids)
    for start in range(0, len(order), GALLERY_SIZE):
        chunk = answer_names[order[start:start + GALLERY_SIZE]]
        assert len(set(chunk)) == len(chunk)


def test_a_perfect_submission_scores_one_and_a_shuffled_one_does_not(source, tmp_path):
    data, root = source
    out = root / "h1"
    assert main(["data", "holdout", data.path, "--seed", "1", "--out", str(out)]) == 0
    test = load_test(out / "test.clean.npz")
    ids, truth = load_answers(out / "answers.npz")
    perfect = tmp_path / "perfect.csv"
    write_submission(perfect, ids, truth)
    assert score_submission(perfect, out / "answers.npz")["mrr"] == pytest.approx(1.0)
    shuffled = tmp_path / "shuffled.csv"
    write_submission(shuffled, test.ids, truth[np.random.default_rng(0).permutation(len(truth))])
    assert score_submission(shuffled, out / "answers.npz")["mrr"] < 0.5


def test_holdouts_depend_on_the_seed_not_on_the_file_order(source):
    from latentsweep.trainers.data.holdout import held_out_images

    data, _ = source
    a = held_out_images(data.image_names, 0.2, 0)
    b = held_out_images(data.image_names, 0.2, 1)
    assert not np.array_equal(a, b)
    perm = np.random.default_rng(0).permutation(len(data.image_names))
    again = held_out_images(data.image_names[perm], 0.2, 0)
    assert set(data.image_names[perm][again]) == set(data.image_names[a])


@pytest.mark.parametrize("fraction", ["0", "1", "1.5", "-0.2", "nan", "0.001", "0.999"])
def test_bad_fractions_are_one_line_errors(source, tmp_path, capsys, fraction):
    data, _ = source
    assert main(["data", "holdout", data.path, "--fraction", fraction, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("latentsweep: error:") and "--fraction" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_file_that_is_not_a_train_file_is_a_one_line_error(source, tmp_path, capsys):
    _, root = source
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    for path in (root / "src" / "test.clean.npz", tmp_path / "junk.npz", tmp_path / "missing.npz"):
        assert main(["data", "holdout", str(path), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("latentsweep: error:") and len(err.splitlines()) == 1
