"""Synthetic challenge-shaped data with a learnable text-to-image relation, for tests, demos and benchmarks."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from latentsweep.trainers.data.writer import write_answers_npz, write_test_npz, write_train_npz

# Real challenge image embeddings are not normalised and have L2 norms around 26 (shared/data-sources.md).
IMAGE_NORM = 26.0
# Real text embeddings are not normalised either; their norm is not published, so this value is ours (kept != 1).
TEXT_NORM = 10.0
# Rows generated per step, so full-size text (125000 x 1024) has no full-size float64 or noise temporaries.
ROW_CHUNK = 16384
# Shape of the relation (our choice): captions see the image latent through this much latent noise (a caption
# describes part of an image), and embeddings carry this much isotropic noise relative to the signal.
# Measured with a text-to-image ridge on galleries of 100 held-out images: MRR about 0.58 at 200 images, dims 32/48,
# and about 0.83 at 3000 images, dims 1024/1536, so the relation is learnable with headroom, not trivial.
CAPTION_LATENT_NOISE = 1.0
EMBEDDING_NOISE = 0.3
# Latent size cap: with a larger latent, 100-image galleries become trivially separable (ridge MRR > 0.97 at 32).
MAX_LATENT_DIM = 16


def _latent_dim(dim_text: int, dim_image: int) -> int:
    return max(2, min(MAX_LATENT_DIM, dim_text // 2, dim_image // 2))


def _project(z: np.ndarray, weight: np.ndarray, bias: np.ndarray, rng, nonlinear: bool) -> np.ndarray:
    """float32 [N, D] = f(z @ weight) + bias + noise, computed ROW_CHUNK rows at a time."""
    out = np.empty((len(z), weight.shape[1]), np.float32)
    for start in range(0, len(z), ROW_CHUNK):
        h = z[start:start + ROW_CHUNK] @ weight
        if nonlinear:
            h = np.tanh(h)
        h += bias
        h += EMBEDDING_NOISE * rng.standard_normal(h.shape, dtype=np.float32)
        out[start:start + ROW_CHUNK] = h
    return out


def _scale_to_norm(x: np.ndarray, norm: float) -> np.ndarray:
    """Scale in place so the mean row norm is `norm` (rows keep their spread: the data is not normalised)."""
    sample = x[:ROW_CHUNK]
    x *= np.float32(norm / np.sqrt(np.einsum("ij,ij->i", sample, sample)).mean())
    return x


def _image_names(n: int, rng) -> np.ndarray:
    # Flickr-like unique names such as '1000092795.jpg': increasing ids with random gaps.
    ids = 1_000_000_000 + 37 * np.arange(n) + rng.integers(0, 37, n)
    return np.array([f"{i}.jpg" for i in ids])


def make_synthetic(n_images: int, captions_per_image: int = 5, dim_text: int = 1024, dim_image: int = 1536,
                   n_labels: int = 0, n_test: int = 0, seed: int = 0) -> dict:
    """Challenge-shaped arrays: {'train': write_train_npz kwargs, 'test': write_test_npz kwargs,
    'answers': write_answers_npz kwargs} ('test'/'answers' only when n_test > 0).

    Each image has a latent z [k]; image = tanh(z A) + bias + noise; each caption = (z + noise) B + bias + noise.
    Captions are shuffled (caption i is not image i // captions_per_image). Test captions come from n_test new
    images, one caption each, ids 1..n_test. Multi-labels (n_labels > 0) threshold a noisy projection of z.
    """
    rng = np.random.default_rng(seed)
    k = _latent_dim(dim_text, dim_image)
    # Weights scaled by 1/sqrt(k) so z @ W has unit variance per column.
    a = (rng.standard_normal((k, dim_image), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
    b = (rng.standard_normal((k, dim_text), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
    image_bias = 0.5 * rng.standard_normal(dim_image, dtype=np.float32)
    text_bias = 0.5 * rng.standard_normal(dim_text, dtype=np.float32)
    z = rng.standard_normal((n_images + n_test, k), dtype=np.float32)
    image = _scale_to_norm(_project(z, a, image_bias, rng, nonlinear=True), IMAGE_NORM)
    names = _image_names(n_images + n_test, rng)

    n_captions = n_images * captions_per_image
    cap2img = np.repeat(np.arange(n_images, dtype=np.int64), captions_per_image)[rng.permutation(n_captions)]
    z_caption = z[np.concatenate([cap2img, np.arange(n_images, n_images + n_test)])]
    z_caption += CAPTION_LATENT_NOISE * rng.standard_normal(z_caption.shape, dtype=np.float32)
    text = _project(z_caption, b, text_bias, rng, nonlinear=False)
    text_scale = TEXT_NORM / np.sqrt(np.einsum("ij,ij->i", text[:ROW_CHUNK], text[:ROW_CHUNK])).mean()
    text *= np.float32(text_scale)

    train = {
        "caption_ids": np.arange(n_captions, dtype=np.int64),
        "caption_text": np.array([f"synthetic caption {c} of {names[i]}" for c, i in enumerate(cap2img)]),
        "text": text[:n_captions], "image": image[:n_images], "cap2img": cap2img, "image_names": names[:n_images],
    }
    if n_labels > 0:
        w = rng.standard_normal((k, n_labels), dtype=np.float32) / np.sqrt(k)
        score = z[:n_images] @ w + 0.5 * rng.standard_normal((n_images, n_labels), dtype=np.float32)
        train["image_labels"] = score > 1.0  # about 16% positives per label (unit-variance score, noise 0.5)
        train["label_names"] = np.array([f"label_{j:02d}" for j in range(n_labels)])
    out = {"train": train}
    if n_test > 0:
        ids = np.arange(1, n_test + 1, dtype=np.int64)
        out["test"] = {"ids": ids, "text": np.array([f"synthetic test caption {i}" for i in ids]),
                       "embeddings": text[n_captions:]}
        out["answers"] = {"ids": ids, "image": image[n_images:], "image_names": names[n_images:]}
    return out


def write_synthetic(out_dir, n_images: int, *, label_chunk_rows: int | None = None,
                    **kwargs) -> tuple[Path, Path | None, Path | None]:
    """Write train.npz (and test.clean.npz, answers.npz when n_test > 0) into out_dir; kwargs go to make_synthetic.

    Returns (train_path, test_path or None, answers_path or None). The dense label is streamed by the writer.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = make_synthetic(n_images, **kwargs)
    train = write_train_npz(out_dir / "train.npz", label_chunk_rows=label_chunk_rows, **data["train"])
    if "test" not in data:
        return train, None, None
    test = write_test_npz(out_dir / "test.clean.npz", **data["test"])
    return train, test, write_answers_npz(out_dir / "answers.npz", **data["answers"])
