"""Challenge data files: read and validate train/test/answers npz files (written by latentsweep.trainers.data.writer,
split by
image in latentsweep.trainers.data.splits)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.core.pages import page_out, seal
from latentsweep.trainers.data.npz import SPARSE_PREFIX, Npz, check_kind, read_cap2img
from latentsweep.trainers.core.progress import say


@dataclass(frozen=True)
class TrainSet:
    path: str
    fingerprint: str
    caption_ids: np.ndarray  # int64 [Nc]
    caption_text: np.ndarray | None  # str [Nc]; None unless load_train(texts=True): training never reads it
    text: np.ndarray  # float32 [Nc, Dt]
    image: np.ndarray  # float32 [Ni, Di]
    cap2img: np.ndarray  # int64 [Nc], image index of each caption
    image_names: np.ndarray  # str [Ni]
    image_labels: np.ndarray | None = None  # bool [Ni, L]
    label_names: np.ndarray | None = None  # str [L]

    def hand_back_pages(self) -> None:
        """Hand the mapped float arrays' pages back (`load_train_shared`'s cache; a parsed copy is left as it is):
        after a search the process held every page of them (0.67 GB at challenge size) while a pick reads only the
        val captions, scattered rows read from then on without the pages around them (`page_out`'s `scattered`);
        what it reads again comes back from the page cache or the file."""
        for array in (self.text, self.image):
            if isinstance(array, np.memmap):
                page_out(array, scattered=True)


@dataclass(frozen=True)
class TestSet:
    path: str
    fingerprint: str
    ids: np.ndarray  # int64 [N]
    text: np.ndarray  # str [N]
    embeddings: np.ndarray  # float32 [N, Dt]


def fingerprint(path) -> str:
    """First 16 hex characters of the sha256 of the file bytes (read in 1 MB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _check_metadata(npz: Npz, expected: dict[str, tuple[int, str]]) -> None:
    """Metadata keys are optional; when present they must agree with the arrays."""
    for name, (value, source) in expected.items():
        key = f"metadata/{name}"
        if key in npz.keys:
            arr = npz.array(key)
            if arr.dtype.kind not in "iu" or arr.size != 1:
                raise npz.error(key, f"has dtype {arr.dtype} and shape {arr.shape}, expected one integer")
            if int(arr.reshape(-1)[0]) != value:
                raise npz.error(key, f"says {int(arr.reshape(-1)[0])} but {source} gives {value}")


def load_train(path, *, texts: bool = False, label_chunk_rows: int | None = None,
               fp: str | None = None) -> TrainSet:
    """Read and validate a challenge train.npz; the dense label is streamed, never held whole.

    texts: keep the caption texts (a holdout writes them); they are always checked, but otherwise dropped, since
    numpy stores them at the longest caption's width (4 bytes a character: 0.2 GB for 125,000 captions of up to 400).
    fp: the file's fingerprint when the caller hashed it already (load_train_shared), else computed here.
    """
    with Npz(path) as npz, ThreadPoolExecutor(1, thread_name_prefix="latentsweep-label") as pool:
        label = _label_beside(pool, npz, label_chunk_rows)
        text = npz.matrix("captions/embeddings")
        nc = len(text)
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", nc, "captions/embeddings"))
        caption_text = npz.vector("captions/text", "U", nc, "captions/embeddings")
        caption_text = caption_text if texts else None
        image = npz.matrix("images/embeddings")
        ni = len(image)
        if ni < 2:  # `data check` must not pass a file that every `train` rejects at the split
            raise npz.error("images/embeddings", f"has {ni} image; a train file needs at least 2 (the validation "
                                                 f"images are held out from the training ones)")
        # names key the hash split and the submission's image lookup: a repeated name would put one image twice
        names = _unique_names(npz, "images/names", npz.vector("images/names", "U", ni, "images/embeddings"))
        cap2img = label.result() if label is not None else read_cap2img(npz, nc, ni, label_chunk_rows)
        labels = label_names = None
        if "images/labels" in npz.keys:
            labels = npz.array("images/labels")
            check_kind(npz, "images/labels", labels, "b", rank=2)
            if len(labels) != ni:
                raise npz.error("images/labels", f"has {len(labels)} rows but images/embeddings has {ni}")
            if "images/label_names" in npz.keys:
                label_names = npz.vector("images/label_names", "U", labels.shape[1], "images/labels (columns)")
        _check_metadata(npz, {
            "num_captions": (nc, "captions/embeddings rows"), "num_images": (ni, "images/embeddings rows"),
            "embedding_dim_text": (text.shape[1], "captions/embeddings columns"),
            "embedding_dim_image": (image.shape[1], "images/embeddings columns")})
    reads["parsed"] += 1
    fp = fingerprint(path) if fp is None else fp  # load_train_shared hashed it already (0.5 s at challenge size)
    data = TrainSet(str(path), fp, ids, caption_text, text, image, cap2img, names, labels, label_names)
    release_free_heap()  # the read buffers and the label's blocks, freed but kept resident by glibc (0.04 GB)
    return data


def _label_beside(pool: ThreadPoolExecutor, npz: Npz, chunk_rows: int | None) -> Future | None:
    """The caption-to-image label read in a thread beside the embeddings, at the sizes their headers declare: at
    challenge size (2 cores, loaded) the label took 2.1 CPU-s in that thread, the main thread 4.5 (captions/embeddings
    most of it: one deflate stream, which one thread inflates); inflate (isal or zlib) and numpy release the GIL.
    None (read after them, in order) when a header is not a matrix's: the embeddings' own reads then say what is
    wrong, as before. The embeddings' checks come first either way; the label's error is raised where its read used
    to be. Tried and not kept (docs/trial-costs.md, "Real size"): images/embeddings in a second thread (the peak rose
    0.04 GB: its array filled while the caption texts were read and dropped) and the fingerprint in this thread after
    the label (no faster on the loaded machine: wall 0.99x, 8 pairs)."""
    try:
        shapes = [npz.header(key)[0] for key in ("captions/embeddings", "images/embeddings")]
    except DataError:
        return None
    if any(len(shape) != 2 for shape in shapes):
        return None
    return pool.submit(read_cap2img, npz, shapes[0][0], shapes[1][0], chunk_rows)


# The TrainSet this process read last (load_train_shared); one at most, so two files are never held for it.
_last_read: list[TrainSet] = []
# Where load_train_shared keeps its memory-mapped copies of train files (one folder per file content): the
# environment's LATENTSWEEP_DATA_CACHE (a folder, or "off"), else a per-user folder in the temp dir.
CACHE_ENV = "LATENTSWEEP_DATA_CACHE"
# Copies kept: a machine's studies read one or two files; an older copy is removed when a new one is written (a
# process that maps it keeps its pages: Linux frees an unlinked file when its last mapping goes).
CACHE_KEEP = 2
# The cache's layout; a copy of another version is rewritten.
CACHE_VERSION = 1
# A staging folder older than this is a dead writer's (writing a challenge-size copy takes seconds): seconds.
STALE_S = 3600.0
_CACHED = ("caption_ids", "text", "image", "cap2img", "image_names", "image_labels", "label_names")
_MAPPED = ("text", "image")  # the float arrays (0.67 GB at challenge size); the rest are small and read whole
# How this process got its train sets: "parsed" (load_train on the npz) and "mapped" (the cache) counts.
reads = {"parsed": 0, "mapped": 0}


def load_train_shared(path) -> TrainSet:
    """`load_train(path)`, read once per machine while `path` holds the same bytes (its sha256 fingerprint: 0.5 s at
    challenge size, against 10-30 s for a parse on 2 cores).

    In a process: the TrainSet it read last is handed out again (a study run's pre-flight check and its trials, and a
    one-budget run's floor, search and pick). Across processes: the first parse writes the arrays as .npy files in a
    cache folder named by the fingerprint (`cache_dir`), and every later load (a spawned worker, the next study on
    the file) maps them copy-on-write (np.load mmap_mode="c"): the workers of one machine share the page cache's one
    copy instead of parsing the npz each and holding a private copy each. A changed file has a new fingerprint, so a
    new folder. The TrainSet stays loaded for the life of the process; callers treat it as read-only (a write lands in
    the process's private copy of that page, never in the file)."""
    try:
        fp = fingerprint(path)
    except OSError:  # gone or unreadable now: load_train says so in its own words
        return _remember(load_train(path))
    if _last_read and os.path.realpath(_last_read[0].path) == os.path.realpath(path) \
            and _last_read[0].fingerprint == fp:
        return _last_read[0]
    _last_read.clear()  # before reading: the old and the new file are never held together
    folder = cache_dir(fp)
    mapped = _open_cached(folder, str(path), fp) if folder is not None else None
    if mapped is not None:
        reads["mapped"] += 1
        return _remember(mapped)
    data = _remember(load_train(path, fp=fp))
    if folder is not None and _write_cached(data, folder):
        # this process maps the copy too: with spawned workers the machine then holds one copy (the page cache's),
        # not this process's private one beside theirs
        data = _remember(_open_cached(folder, str(path), fp) or data)
    return data


def _remember(data: TrainSet) -> TrainSet:
    _last_read[:] = [data]
    return data


def cache_dir(fp: str) -> Path | None:
    """The cache folder of the train file with fingerprint `fp`, None when the cache is off (CACHE_ENV=off)."""
    root = os.environ.get(CACHE_ENV, "")
    if root.strip().lower() == "off":
        return None
    base = Path(root) if root else Path(tempfile.gettempdir()) / f"latentsweep-data-{os.getuid()}"
    return base / f"v{CACHE_VERSION}-{fp}"


def _open_cached(folder: Path, path: str, fp: str) -> TrainSet | None:
    """The TrainSet mapped from `folder` (written whole by _write_cached: its done.json is the last file written), or
    None when there is no complete copy there."""
    try:
        done = json.loads((folder / "done.json").read_text())
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="c" if name in _MAPPED else None,
                                allow_pickle=False) if name in done["arrays"] else None for name in _CACHED}
    except (OSError, ValueError, KeyError, TypeError):  # absent, half-removed or not ours: parse the npz instead
        return None
    os.utime(folder / "done.json")  # recently used: the last to be evicted
    for name in _MAPPED:  # read-only from here on; rows are read from the file (pages.take), never mapped
        if arrays[name] is not None:
            seal(arrays[name])
    return TrainSet(path, fp, arrays["caption_ids"], None, arrays["text"], arrays["image"], arrays["cap2img"],
                    arrays["image_names"], arrays["image_labels"], arrays["label_names"])


def _write_cached(data: TrainSet, folder: Path) -> bool:
    """Write `data`'s arrays into `folder` for the next process (staged, then one rename); whether the folder holds a
    complete copy now. A cache that cannot be written (a full or read-only disk) only costs the next process a parse,
    so a failure is said and dropped."""
    names = [name for name in _CACHED if getattr(data, name) is not None]
    try:
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        need = sum(getattr(data, name).nbytes for name in names)
        if shutil.disk_usage(folder.parent).free < 2 * need:  # never fill the disk for a cache
            say(f"no data cache: {folder.parent} has under {2 * need >> 20} MB free")
            return False
        staged = Path(tempfile.mkdtemp(prefix=".staged-", dir=folder.parent))
        try:
            for name in names:
                np.save(staged / f"{name}.npy", getattr(data, name), allow_pickle=False)
            (staged / "done.json").write_text(json.dumps({"arrays": names, "source": data.path}))
            os.rename(staged, folder)  # fails when another process wrote it first: theirs is as good
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
            if not (folder / "done.json").is_file():
                raise
        _evict(folder.parent, keep=folder)
    except OSError as exc:
        say(f"no data cache in {folder.parent} ({exc}): the next process parses the npz again")
        return False
    return True


def _evict(root: Path, keep: Path) -> None:
    """Remove all but the CACHE_KEEP most recently used copies in `root` (never `keep`), and the staging folders of
    writers that died (untouched for STALE_S)."""
    copies = sorted((p for p in root.glob("v*-*") if p != keep and (p / "done.json").is_file()),
                    key=lambda p: (p / "done.json").stat().st_mtime, reverse=True)
    stale = [p for p in root.glob(".staged-*") if time.time() - p.stat().st_mtime > STALE_S]
    for old in copies[CACHE_KEEP - 1:] + stale:
        shutil.rmtree(old, ignore_errors=True)


def _unique_ids(npz: Npz, key: str, ids: np.ndarray) -> np.ndarray:
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        raise npz.error(key, f"row {int(order[dup[0] + 1])} repeats id {int(ids[order[dup[0]]])}")
    return ids


def _unique_names(npz: Npz, key: str, names: np.ndarray) -> np.ndarray:
    uniq, first, counts = np.unique(names, return_index=True, return_counts=True)
    if (counts > 1).any():
        name = uniq[np.argmax(counts > 1)]
        rows = np.flatnonzero(names == name)[:2]
        raise npz.error(key, f"rows {int(rows[0])} and {int(rows[1])} both name image {str(name)[:80]!r}")
    return names


def load_test(path) -> TestSet:
    """Read and validate a test.clean.npz (captions only)."""
    with Npz(path) as npz:
        if "captions/label" in npz.keys or SPARSE_PREFIX + "indptr" in npz.keys:  # the labels make a train file
            raise DataError(f"{path}: a train file (it has captions/label), not a test file: pass the "
                            "test.clean.npz of the challenge or of `latentsweep data holdout`")
        emb = npz.matrix("captions/embeddings")
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", len(emb), "captions/embeddings"))
        text = npz.vector("captions/text", "U", len(emb), "captions/embeddings")
        _check_metadata(npz, {"num_captions": (len(emb), "captions/embeddings rows"),
                              "embedding_dim_text": (emb.shape[1], "captions/embeddings columns")})
    return TestSet(str(path), fingerprint(path), ids, text, emb)


# The TestSet this process read last (load_test_shared) with the file's identity then: one at most.
_last_test: list[tuple[tuple, TestSet]] = []


def load_test_shared(path) -> TestSet:
    """`load_test(path)`, read once per process while `path` is the same, unchanged file (its inode, size and
    modification time): a one-budget run checks its test file before a store is opened, then its floor, keeper and
    pick use it. Callers treat it as read-only."""
    try:
        st = os.stat(path)
    except OSError:  # gone or unreadable now: load_test says so in its own words
        return load_test(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if not _last_test or _last_test[0][0] != key:
        _last_test[:] = [(key, load_test(path))]
    return _last_test[0][1]


def load_answers(path) -> tuple[np.ndarray, np.ndarray]:
    """Read an answer key: (ids int64 [N], true image embedding of each test caption float32 [N, Di])."""
    with Npz(path) as npz:
        image = npz.matrix("images/embeddings")
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", len(image), "images/embeddings"))
        if "images/names" in npz.keys:
            npz.vector("images/names", "U", len(image), "images/embeddings")
    return ids, image


def check_text_dim(test: TestSet, dim_in: int, expected_by: str = "the model expects") -> None:
    """Raise DataError when the test file's text embeddings are not `dim_in` wide (what the model was trained on)."""
    if test.embeddings.shape[1] != dim_in:
        raise DataError(f"{test.path}: captions/embeddings has dim {test.embeddings.shape[1]}, {expected_by} "
                        f"{dim_in}")


def describe_npz(path) -> dict:
    """{'kind': 'train'|'test'|'answers', 'label_format': ..., 'keys': {key: (shape, dtype)}} from headers only."""
    with Npz(path) as npz:
        keys = {}
        for key in npz.keys:
            shape, _, dtype = npz.header(key)
            keys[key] = (tuple(shape), dtype)
    if "captions/label" in keys:
        fmt = "index" if len(keys["captions/label"][0]) == 1 else "dense"
    else:
        fmt = "sparse" if SPARSE_PREFIX + "indptr" in keys else None
    if fmt is not None:
        kind = "train"
    elif "captions/embeddings" in keys:
        kind = "test"
    elif "images/embeddings" in keys:
        kind = "answers"
    else:
        raise DataError(f"{path}: cannot tell the file kind: no key 'captions/label' (train), "
                        f"'captions/embeddings' (test) or 'images/embeddings' (answers); keys: {sorted(keys)}")
    return {"kind": kind, "label_format": fmt, "keys": keys}
