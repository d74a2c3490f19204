"""Tests of latentsweep.trainers.eval.metrics: ranks against a naive oracle, summaries, and the global / leaderboard
protocols."""
import math

import numpy as np
import pytest
import torch

from latentsweep.trainers.eval import metrics as M


def oracle_ranks(queries, gallery, target):
    """Plain per-query ranking: 1 + count of gallery items with strictly higher cosine similarity (float64)."""
    q = np.asarray(queries, dtype=np.float64)
    g = np.asarray(gallery, dtype=np.float64)
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    g = g / np.linalg.norm(g, axis=1, keepdims=True)
    out = []
    for i in range(len(q)):
        sims = g @ q[i]
        order = np.argsort(-sims, kind="stable")
        true = sims[target[i]]
        position = int(np.flatnonzero(order == target[i])[0])
        # Walk back over items sorted before the true one that only tie with it: ties favour the true item.
        while position > 0 and sims[order[position - 1]] == true:
            position -= 1
        out.append(position + 1)
    return np.array(out)


def sign_vectors(rng, n, d=64):
    """±1 vectors: norm sqrt(64) = 8 exactly, so normalised dot products are exact k/64 and ties are exact."""
    return rng.choice([-1.0, 1.0], size=(n, d)).astype(np.float32)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_ranks_match_oracle_with_exact_ties(chunk):
    rng = np.random.default_rng(1)
    gallery = sign_vectors(rng, 40)
    gallery[10] = gallery[3]                      # duplicate gallery vectors
    gallery[20] = gallery[3]
    queries = sign_vectors(rng, 57)
    queries[:5] = gallery[[3, 10, 20, 0, 1]]      # queries exactly equal to (duplicated) gallery items
    target = rng.integers(0, 40, size=57)
    target[:3] = [3, 10, 20]
    got = M.ranks(queries, gallery, target, chunk=chunk)
    want = oracle_ranks(queries, gallery, target)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    assert (got[:3] == 1).all()                   # exact duplicates never push the true item down
    sims = (queries / 8.0) @ (gallery / 8.0).T
    assert any(np.sum(row == row[t]) > 1 for row, t in zip(sims, target))  # ties really happen


@pytest.mark.parametrize("chunk", [1, 7, 500])
def test_ranks_match_oracle_on_gaussian_data(chunk):
    rng = np.random.default_rng(2)
    gallery = rng.standard_normal((60, 24)).astype(np.float32)
    queries = rng.standard_normal((90, 24)).astype(np.float32)
    target = rng.integers(0, 60, size=90)
    got = M.ranks(torch.from_numpy(queries), torch.from_numpy(gallery), torch.from_numpy(target), chunk=chunk)
    want = oracle_ranks(queries, gallery, target)
    # float32 vs float64 may only disagree when two similarities are closer than float32 resolution.
    g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    sims = q @ g.T
    gap = np.abs(sims - sims[np.arange(90), target][:, None])
    gap[np.arange(90), target] = np.inf
    clear = gap.min(axis=1) > 1e-5
    assert clear.sum() > 80
    np.testing.assert_array_equal(got[clear], want[clear])


def test_true_item_compared_within_its_own_row():
    # The query is the true image scaled: its cosine is 1 up to rounding, and so is a duplicate of that image.
    rng = np.random.default_rng(3)
    gallery = rng.standard_normal((30, 17)).astype(np.float32)
    gallery[7] = gallery[4]
    queries = gallery[[4, 7, 4]] * np.float32(3.7)
    assert (M.ranks(queries, gallery, [4, 7, 7], chunk=2) == 1).all()


def test_degenerate_queries_get_the_worst_rank():
    rng = np.random.default_rng(4)
    gallery = rng.standard_normal((12, 8)).astype(np.float32)
    queries = gallery[:3].copy()
    queries[1] = 0.0                              # would tie with everything
    queries[2, 0] = np.nan
    np.testing.assert_array_equal(M.ranks(queries, gallery, [0, 1, 2]), [1, 12, 12])


def test_degenerate_gallery_rows():
    rng = np.random.default_rng(8)
    gallery = rng.standard_normal((10, 8)).astype(np.float32)
    queries = gallery[:3].copy()
    gallery[5, 2] = np.inf                        # a broken distractor never outranks anything
    gallery[6] = 0.0                              # a zero true image cannot be found
    got = M.ranks(queries, gallery, [0, 1, 6])
    np.testing.assert_array_equal(got, [1, 1, 10])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inputs_give_the_same_results():
    rng = np.random.default_rng(9)
    image = rng.standard_normal((120, 16)).astype(np.float32)
    cap2img = rng.integers(0, 120, size=400)
    pred = image[cap2img] + rng.standard_normal((400, 16)).astype(np.float32)
    cpu = M.evaluate(pred, image, cap2img, gallery_size=50)
    gpu = M.evaluate(torch.from_numpy(pred).cuda(), torch.from_numpy(image).cuda(), cap2img, gallery_size=50)
    assert gpu == pytest.approx(cpu, abs=0.01)    # TF32 matmuls may move near-ties


def test_ranks_reject_bad_shapes():
    with pytest.raises(ValueError):
        M.ranks(np.ones((3, 4)), np.ones((5, 3)), [0, 1, 2])
    with pytest.raises(ValueError):
        M.ranks(np.ones((3, 4)), np.ones((5, 4)), [0, 1, 5])


def test_summarize_hand_values():
    out = M.summarize([1, 2, 4, 101])
    assert out["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4 + 1 / 101) / 4)
    assert out["r1"] == 0.25 and out["r5"] == 0.75 and out["r10"] == 0.75 and out["r50"] == 0.75
    assert out["ndcg100"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(5) + 0) / 4)
    assert out["median_rank"] == 3.0
    assert out["p75_rank"] == pytest.approx(np.percentile([1, 2, 4, 101], 75))
    assert set(out) == set(M.METRIC_KEYS)


def test_known_tiny_example():
    image = np.array([[1, 0], [0, 1], [-1, 0]], dtype=np.float32)
    pred = np.array([[1, 0],      # caption of image 0: rank 1
                     [1, 0.1],    # caption of image 1: image 0 is closer, rank 2
                     [0, 1]],     # caption of image 2: image 1 closer, image 0 only ties, rank 2
                    dtype=np.float32)
    out = M.evaluate_global(pred, image, [0, 1, 2])
    assert out["mrr"] == pytest.approx(2 / 3)
    assert out["r1"] == pytest.approx(1 / 3)
    assert out["median_rank"] == 2.0


def check_galleries(cap2img, n_images, size, seed):
    galleries, owner, views = M.leaderboard_galleries(cap2img, n_images, size, seed)
    captioned = np.unique(cap2img)
    expect = min(size, captioned.size)
    assert galleries.shape[1] == expect
    for row in galleries:
        assert len(set(row.tolist())) == expect   # never a repeated image inside a gallery
    assert np.isin(galleries, captioned).all()
    np.testing.assert_array_equal(np.sort(galleries[owner]), captioned)  # each captioned image queried once
    assert views.shape == (np.bincount(cap2img).max(), *galleries.shape)
    for view in views:
        assert (view[~owner] == -1).all()
        np.testing.assert_array_equal(cap2img[view[owner]], galleries[owner])  # one caption of its own image
    return galleries, owner, views


@pytest.mark.parametrize("n_images,size", [(250, 100), (300, 100), (37, 100), (101, 10), (5, 1)])
def test_leaderboard_galleries_distinct_and_full(n_images, size):
    rng = np.random.default_rng(n_images)
    counts = rng.integers(1, 7, size=n_images)
    cap2img = np.repeat(np.arange(n_images), counts)
    rng.shuffle(cap2img)
    galleries, owner, views = check_galleries(cap2img, n_images + 3, size, seed=0)   # 3 uncaptioned images
    assert owner.sum() == n_images
    for img in range(n_images):                   # views cycle through every caption of every image
        slot = np.argwhere((galleries == img) & owner)[0]
        assert set(views[:, slot[0], slot[1]].tolist()) == set(np.flatnonzero(cap2img == img).tolist())


def test_leaderboard_galleries_depend_on_seed_only():
    cap2img = np.repeat(np.arange(230), 5)
    a = M.leaderboard_galleries(cap2img, 230, 100, seed=0)[0]
    b = M.leaderboard_galleries(cap2img, 230, 100, seed=0)[0]
    c = M.leaderboard_galleries(cap2img, 230, 100, seed=1)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_leaderboard_matches_per_gallery_oracle():
    rng = np.random.default_rng(5)
    n_img, dim = 130, 16
    image = rng.standard_normal((n_img, dim)).astype(np.float32)
    cap2img = np.repeat(np.arange(n_img), rng.integers(1, 6, size=n_img))
    pred = image[cap2img] + rng.standard_normal((cap2img.size, dim)).astype(np.float32)
    galleries, owner, views = M.leaderboard_galleries(cap2img, n_img, 50, seed=3)
    per_view = []
    for view in views:
        r = [oracle_ranks(pred[view[b][owner[b]]], image[galleries[b]], np.flatnonzero(owner[b]))
             for b in range(len(galleries))]
        per_view.append(M.summarize(np.concatenate(r)))
    want = {k: np.mean([m[k] for m in per_view]) for k in M.METRIC_KEYS}
    got = M.evaluate_leaderboard(pred, image, cap2img, gallery_size=50, seed=3, chunk=7)
    for k in M.METRIC_KEYS:
        assert got[k] == pytest.approx(want[k]), k
    assert 0.2 < got["mrr"] < 0.99               # informative, not trivially perfect


@pytest.mark.parametrize("case", range(12))
def test_leaderboard_alone_ranks_as_the_one_pass_does(case):
    """evaluate_leaderboard ranks gallery by gallery (its captions against its S images only); evaluate reads the same
    ranks out of the global pass's blocks, and a Queries input ranks in those blocks: all three agree exactly, with
    duplicated images (ties), zero and non-finite images and predictions, and odd gallery and chunk sizes."""
    rng = np.random.default_rng(100 + case)
    n_img, dim = int(rng.integers(3, 200)), int(rng.integers(2, 12))
    image = rng.standard_normal((n_img, dim)).astype(np.float32)
    image[rng.integers(0, n_img, 3)] = image[0]
    image[rng.integers(0, n_img)] = 0
    image[rng.integers(0, n_img), 0] = np.nan if case % 2 else np.inf
    cap2img = rng.integers(0, n_img, int(rng.integers(n_img, 4 * n_img)))
    pred = image[cap2img] + rng.uniform(0.1, 2) * rng.standard_normal((cap2img.size, dim)).astype(np.float32)
    pred[rng.integers(0, len(pred), 2)] = 0
    pred[rng.integers(0, len(pred)), 1] = np.nan
    size, seed, chunk = int(rng.integers(1, 90)), int(rng.integers(0, 4)), int(rng.integers(1, 40))
    alone = M.evaluate_leaderboard(pred, image, cap2img, gallery_size=size, seed=seed, chunk=chunk)
    one_pass = M.evaluate(pred, image, cap2img, gallery_size=size, seed=seed, chunk=chunk)
    queries = M.Queries(len(pred), dim, torch.device("cpu"), lambda a, b: torch.from_numpy(pred[a:b]))
    blocks = M.evaluate_leaderboard(queries, image, cap2img, gallery_size=size, seed=seed, chunk=chunk)
    assert all(alone[k] == one_pass[k] == blocks[k] for k in M.METRIC_KEYS), (alone, one_pass, blocks)


def test_five_copies_trap_does_not_occur():
    # 5 consecutive captions per image: cutting captions into chunks of 100 would put 5 copies of an image in a gallery.
    rng = np.random.default_rng(6)
    image = rng.standard_normal((200, 32)).astype(np.float32)
    cap2img = np.repeat(np.arange(200), 5)
    galleries, _, views = check_galleries(cap2img, 200, 100, seed=0)
    assert all(len(set(cap2img[v[b]].tolist())) == 100 for v in views for b in range(len(galleries)))
    perfect = image[cap2img]
    out = M.evaluate(perfect, image, cap2img)
    assert out["mrr"] == 1.0 and out["mrr_global"] == 1.0


def test_evaluate_keys_and_global_part():
    rng = np.random.default_rng(7)
    image = rng.standard_normal((80, 12)).astype(np.float32)
    cap2img = rng.integers(0, 80, size=300)
    pred = image[cap2img] + 1.5 * rng.standard_normal((300, 12)).astype(np.float32)
    out = M.evaluate(torch.from_numpy(pred), image, cap2img, gallery_size=30, seed=2)
    assert set(out) == set(M.METRIC_KEYS) | {k + "_global" for k in M.METRIC_KEYS}
    glob = M.summarize(oracle_ranks(pred, image, cap2img))
    for k in M.METRIC_KEYS:
        assert out[k + "_global"] == pytest.approx(glob[k])
    lead = M.evaluate_leaderboard(pred, image, cap2img, gallery_size=30, seed=2)
    assert all(out[k] == pytest.approx(lead[k]) for k in M.METRIC_KEYS)
    assert out["mrr"] > out["mrr_global"]          # 30 distractors are easier than 79


@pytest.mark.parametrize("n", [100, 250, 37])
def test_leaderboard_from_ordered_matches_chunk_oracle(n):
    rng = np.random.default_rng(n)
    truth = rng.standard_normal((n, 10)).astype(np.float32)
    truth[5] = truth[6]                            # the same image twice in a chunk ties, never penalised
    pred = truth + rng.standard_normal((n, 10)).astype(np.float32)
    want = np.concatenate([oracle_ranks(pred[s:s + 100], truth[s:s + 100], np.arange(min(100, n - s)))
                           for s in range(0, n, 100)])
    got = M.leaderboard_from_ordered(pred, truth, gallery_size=100)
    for k, v in M.summarize(want).items():
        assert got[k] == pytest.approx(v), k
    assert M.leaderboard_from_ordered(truth, truth)["mrr"] == 1.0


def _naive_label_retrieval(emb, labels, k):
    """Oracle: sort every other item by cosine (stable, relevant first among ties), find the first relevant one."""
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = e @ e.T
    rr, hits = [], []
    for q in range(len(e)):
        others = [j for j in range(len(e)) if j != q]
        rel = {j for j in others if (labels[q] & labels[j]).any()}
        if not rel:
            continue
        best = max(sim[q, j] for j in rel)
        rank = 1 + sum(1 for j in others if j not in rel and sim[q, j] > best)
        rr.append(1 / rank)
        hits.append(rank <= k)
    return float(np.mean(rr)), float(np.mean(hits)), len(rr)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_label_retrieval_matches_naive_oracle(chunk):
    from latentsweep.trainers.eval.metrics import label_retrieval

    rng = np.random.default_rng(3)
    emb = rng.normal(size=(40, 6)).astype(np.float32)
    emb[5] = emb[7]  # an exact tie
    labels = rng.random((40, 4)) < 0.25
    labels[0] = False  # a query with no relevant item is left out
    got = label_retrieval(emb, labels, k=5, chunk=chunk)
    mrr, recall, n = _naive_label_retrieval(emb, labels, 5)
    assert got["mrr"] == pytest.approx(mrr)
    assert got["recall@5"] == pytest.approx(recall)
    assert got["queries"] == n


def test_queries_made_block_by_block_give_the_same_ranks_and_metrics():
    """A Queries (made one block at a time, e.g. a model's predictions) ranks exactly as the held tensor, degenerate
    rows included, and the metrics ask for each block once and never for more rows than one block."""
    rng = np.random.default_rng(11)
    image = rng.standard_normal((70, 16)).astype(np.float32)
    cap2img = rng.integers(0, 70, size=230)
    pred = image[cap2img] + rng.standard_normal((230, 16)).astype(np.float32)
    pred[150] = 0.0                                # degenerate rows inside a later block
    pred[201, 3] = np.nan
    asked = []

    def make(start, stop):
        asked.append((start, stop))
        return torch.from_numpy(pred[start:stop])

    lazy = M.Queries(len(pred), pred.shape[1], "cpu", make)
    assert M.evaluate(lazy, image, cap2img, gallery_size=25, seed=3, chunk=64) == \
        M.evaluate(pred, image, cap2img, gallery_size=25, seed=3, chunk=64)
    assert asked == [(0, 64), (64, 128), (128, 192), (192, 230)]
    got = M.ranks(M.Queries(len(pred), pred.shape[1], "cpu", make), image, cap2img, chunk=100)
    np.testing.assert_array_equal(got, M.ranks(pred, image, cap2img))
    assert got[150] == got[201] == 70              # the worst rank, as for a held tensor


def test_row_queries_rank_gallery_by_gallery_as_the_held_array():
    """A RowQueries (rows made when a gallery ranks them, e.g. an ensemble's sums) gives the leaderboard ranks and
    metrics of the held array exactly, degenerate rows included, asks only for rows it was given (each once), and
    np.asarray makes the whole array."""
    rng = np.random.default_rng(12)
    image = rng.standard_normal((70, 16)).astype(np.float32)
    cap2img = rng.integers(0, 70, size=230)
    pred = image[cap2img] + rng.standard_normal((230, 16)).astype(np.float32)
    pred[150] = 0.0
    pred[201, 3] = np.nan
    asked = []

    def take(rows):
        asked.append(rows.copy())
        return pred[rows]

    lazy = M.RowQueries(len(pred), pred.shape[1], take)
    assert M.evaluate_leaderboard(lazy, image, cap2img, gallery_size=25, seed=3) == \
        M.evaluate_leaderboard(pred, image, cap2img, gallery_size=25, seed=3)
    got, mrr = M.leaderboard_ranks(lazy, image, cap2img, gallery_size=25, seed=3)
    want, want_mrr = M.leaderboard_ranks(pred, image, cap2img, gallery_size=25, seed=3)
    np.testing.assert_array_equal(got, want)
    assert mrr == want_mrr and got[150] == got[201] == 25
    asked_rows = np.concatenate(asked)
    assert np.array_equal(np.sort(asked_rows[:len(pred)]), np.arange(len(pred)))  # the first pass: each row once
    np.testing.assert_array_equal(np.asarray(lazy), pred)


def test_rank_against_counts_strictly_higher_counted_columns_only():
    """The one rank rule, on scores with exact ties and a column mask, against a loop by the definition."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (30, 12), generator=gen).float()  # few values: many exact ties
    true = torch.randint(0, 4, (30, 1), generator=gen).float()
    counted = torch.rand(30, 12, generator=gen) > 0.3
    naive = [1 + sum(float(scores[i, j]) > float(true[i]) and bool(counted[i, j]) for j in range(12))
             for i in range(30)]
    assert M.rank_against(scores, true, counted).tolist() == naive
    assert M.rank_against(scores, true).tolist() == [1 + int((scores[i] > true[i]).sum()) for i in range(30)]
