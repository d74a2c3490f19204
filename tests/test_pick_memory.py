"""What the pick and the knn model hold at challenge size, as behaviour: the selection reads its members in place
(no [Nc, D] array besides them) and chooses what copies of every fold's rows choose; the knn model's keys and images
are the loaded data's memory, in a trial and, once shared, in a pick; ensembles are made one member at a time, and a
judge's score one gallery at a time."""
from __future__ import annotations

import tracemalloc
import weakref

import numpy as np
import pytest
import torch

from latentsweep.search.pick import ensemble, oof
from latentsweep.search.pick.candidates import share_data
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.eval.metrics import evaluate_leaderboard
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.train.loop import train
from latentsweep.trainers.train.tasks import predict


def members(n_images: int = 4000, caps_per_image: int = 5, dim: int = 256, n: int = 3, seed: int = 0,
            noise: float = 6.0):
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((n_images, dim)).astype(np.float32)
    cap2img = np.repeat(np.arange(n_images), caps_per_image)
    outs = [image[cap2img] + rng.standard_normal((len(cap2img), dim)).astype(np.float32) * noise * (1 + 0.1 * i)
            for i in range(n)]
    return image, cap2img, outs


def naive_greedy(outputs, mrr_of, size):
    """Caruana's forward selection as first written: a running sum, each trial a new normalised array."""
    singles = [mrr_of(o) for o in outputs]
    counts = np.zeros(len(outputs), np.int64)
    best = int(np.argmax(singles))
    counts[best], running, current = 1, np.array(outputs[best], np.float32), singles[best]
    for _ in range(size - 1):
        trials = [mrr_of(ensemble.l2n(running + o)) for o in outputs]
        pick = int(np.argmax(trials))
        if trials[pick] <= current:
            break
        counts[pick] += 1
        running += outputs[pick]
        current = trials[pick]
    return counts / counts.sum()


def naive_nested(outs, folds: oof.Folds, image, size):
    """The nested selection on copies: each fold's rows gathered and normalised per member, as first written."""
    def choose(caps, score):
        normed = [ensemble.l2n(o[caps]) for o in outs]
        mrr = lambda p: score(p)["mrr"]  # noqa: E731
        return naive_greedy(normed, mrr, size), int(np.argmax([mrr(o[caps]) for o in outs]))

    caps, score = oof.images_scorer(np.arange(len(folds.fold_of)), image, folds.cap2img)
    weights, _ = choose(caps, score)
    gains, members = [], []
    for g in range(folds.n):
        w_g, best_g = choose(*oof.images_scorer(folds.images(set(range(folds.n)) - {g}), image, folds.cap2img))
        out_caps, out_score = oof.images_scorer(folds.images({g}), image, folds.cap2img)
        fold = [o[out_caps] for o in outs]
        members.append([out_score(o)["mrr"] for o in fold])
        gains.append(out_score(ensemble.combine(fold, w_g))["mrr"] - members[-1][best_g])
    return weights, np.array(gains), np.mean(members, axis=0)


def test_the_selection_holds_one_member_at_a_time_and_their_similarities():
    """The out-of-fold selection reads its members one at a time (here a generator makes each as it is read) and
    keeps only their similarities in each image set's galleries ((folds + 1) x 100 floats a caption and member: 0.39
    of a member's rows at 1,536 dims, as at challenge size): every member is let go before the next is made, its numpy
    allocations peak below the similarities plus one member and its galleries (holding the members was 3 members
    more), and it chooses exactly what a selection on copies of every fold's rows chooses."""
    image, cap2img, outs = members(n_images=1000, dim=1536)
    folds = oof.Folds(np.arange(len(image)) % 5, cap2img)
    weights, gains, member_mrr = naive_nested(outs, folds, image, 6)
    made, alive_at_each = [], []

    def one_at_a_time():
        for out in outs:
            alive_at_each.append(sum(ref() is not None for ref in made))
            member = out.copy()
            made.append(weakref.ref(member))
            yield member
            del member

    tracemalloc.start()
    try:
        got = oof.nested_select(one_at_a_time(), folds, image, "greedy", 6, in_place=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert alive_at_each == [0, 0, 0]
    similarities = len(outs) * len(cap2img) * (folds.n + 1) * 100 * 4
    assert similarities < 1.2 * outs[0].nbytes
    assert peak < similarities + 1.5 * outs[0].nbytes  # a member, its galleries' images (a fifth) and a block
    np.testing.assert_array_equal(got.weights, weights)
    np.testing.assert_array_equal(got.fold_gains, gains)
    np.testing.assert_array_equal(got.member_mrr, member_mrr)
    assert (got.weights > 0).sum() > 1  # independent noise: an ensemble was chosen, not one member
    given = [o.copy() for o in outs]
    in_place = oof.nested_select(given, folds, image, "greedy", 6, in_place=True)
    np.testing.assert_array_equal(given[1], ensemble.l2n(outs[1]))  # the members, normalised in place
    copied = oof.nested_select([o.copy() for o in outs], folds, image, "greedy", 6)  # not in place: the same
    np.testing.assert_array_equal(copied.fold_gains, in_place.fold_gains)


@pytest.mark.parametrize("rows", [None, "half"])
def test_greedy_in_one_buffer_chooses_what_a_running_sum_chooses(rows):
    image, cap2img, outs = members(n_images=200, dim=32, n=4, seed=1, noise=1.6)
    caps = np.arange(len(cap2img)) if rows is None else np.flatnonzero(cap2img % 2 == 0)
    gallery = image if rows is None else image[::2]
    target = cap2img[caps] if rows is None else cap2img[caps] // 2
    mrr = lambda p: evaluate_leaderboard(p, gallery, target, gallery_size=100)["mrr"]  # noqa: E731
    normed = [ensemble.l2n(o) for o in outs]
    want = naive_greedy([n[caps] for n in normed], mrr, 8)
    got = ensemble.method_weights("greedy", normed, mrr, 8, None if rows is None else caps, normalised=True)
    np.testing.assert_array_equal(got, want)
    assert (got > 0).sum() > 1


def test_an_ensemble_is_predicted_one_member_at_a_time_with_the_same_values():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 6) for _ in range(3)]
    wrapped = [lambda x, m=m: {"pred": m(x)} for m in models]
    x = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)

    class Model(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return {"pred": self.inner(x)}

    models = [Model(m) for m in models]
    weights = [0.5, 0.0, 0.25]
    want = ensemble.combine(ensemble.predict_all(models, x, "cpu"), weights)
    np.testing.assert_array_equal(ensemble.predict_combined(models, weights, x, "cpu"), want)
    caps = np.array([3, 0, 7, 7, 49])
    rows = ensemble.caption_rows(x, caps, "cpu")  # read in place, gathered per block
    np.testing.assert_array_equal(ensemble.predict_all(models, rows, "cpu")[0],
                                  ensemble.predict_all(models, x[caps], "cpu")[0])
    assert len(wrapped) == 3


class _Counted(torch.nn.Module):
    """A linear translator recording how many caption rows each call predicts."""

    def __init__(self, dim_in: int, dim_out: int, seen: list[int]):
        super().__init__()
        self.inner, self.seen = torch.nn.Linear(dim_in, dim_out), seen

    def forward(self, x):
        self.seen.append(len(x))
        return {"pred": self.inner(x)}


@pytest.mark.parametrize("n_models", [1, 2])
def test_the_judge_scores_gallery_by_gallery_as_the_held_predictions(tmp_path, n_models):
    """A judge's score (the keeper's, beside a trial; the gate's) predicts the val captions as each gallery is ranked:
    every caption once, never all of them in one call, and the same Score as the held predictions give."""
    from latentsweep.search.pick.judge import make_judge

    path, _, _ = write_synthetic(tmp_path, 1_000, dim_text=24, dim_image=16)  # about 200 val images: 2 galleries
    data = load_train(path)
    judge = make_judge(Config(), data)
    torch.manual_seed(0)
    seen: list[int] = []
    models = [_Counted(data.text.shape[1], data.image.shape[1], seen) for _ in range(n_models)]
    weights = [0.75, 0.25][:n_models]
    got = judge.score_models(models, weights, "cpu")
    assert sum(seen) == n_models * len(judge.caps) and max(seen) < len(judge.caps)
    held = ensemble.predict_all(models, judge.text, "cpu")
    want = judge.score(held[0] if n_models == 1 else ensemble.combine(held, weights))
    assert got.mrr == pytest.approx(want.mrr, abs=1e-12)
    np.testing.assert_allclose(got.per_image, want.per_image, atol=1e-12)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path, _, _ = write_synthetic(tmp_path_factory.mktemp("knnmem"), 150, dim_text=24, dim_image=16)
    return load_train(path)


def _own_bytes(model: torch.nn.Module, shared: list[torch.Tensor]) -> int:
    """Bytes of the model's buffers that are not views of `shared` (the loaded data's arrays)."""
    owners = {t.untyped_storage().data_ptr() for t in shared}
    return sum(b.numel() * b.element_size() for b in model.buffers()
               if b.untyped_storage().data_ptr() not in owners)


def test_a_knn_models_keys_and_images_are_the_loaded_datas_memory(data, tmp_path):
    """A knn trial's model reads its keys and images from the loaded arrays (at challenge size a normalised copy of
    the training captions was 0.41 GB and of the images 0.12 GB); its own buffers are index vectors and the [Dt]
    means. Loaded from its checkpoint, it reads the checkpoint's copy until it shares the job's data, then predicts
    the same rows from the data's memory."""
    cfg = with_values(Config(), {"model.kind": "knn", "eval.gallery_size": 20, "train.device": "cpu"})
    result = train(cfg, data, out_dir=tmp_path)
    text, image = torch.as_tensor(data.text), torch.as_tensor(data.image)
    inner = result.model.inner
    assert inner.key_base.data_ptr() == text.data_ptr() and inner.value_base.data_ptr() == image.data_ptr()
    keys_bytes = len(inner.key_rows) * data.text.shape[1] * 4
    assert _own_bytes(result.model, [text, image]) - inner.memo.rows.nbytes < keys_bytes / 4
    loaded, _, meta = load_model(tmp_path / "best.pt")
    x = torch.as_tensor(data.text[:9]) + 0.01  # rows it never saw: computed from the keys
    before = predict(loaded, x)
    assert loaded.inner.key_base.data_ptr() != text.data_ptr()  # the checkpoint's copy
    assert share_data(loaded, data, meta["data_fingerprint"])
    assert loaded.inner.key_base.data_ptr() == text.data_ptr() and loaded.inner.value_base.data_ptr() == image.data_ptr()
    loaded.inner.memo = type(loaded.inner.memo)(loaded.inner.dim_out)  # computed again, from the data's memory
    torch.testing.assert_close(predict(loaded, x), before, rtol=0, atol=0)
    assert not share_data(loaded, data, "another file")
    other = load_train(write_synthetic(tmp_path / "other", 150, dim_text=24, dim_image=16, seed=5)[0])
    fresh, _, _ = load_model(tmp_path / "best.pt")
    assert not fresh.inner.share_rows(torch.as_tensor(other.text), torch.as_tensor(other.image))  # other rows
