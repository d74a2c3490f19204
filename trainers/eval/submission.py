"""Submission CSV I/O: atomic writing, strict reading, checking against the test set, and leaderboard scoring.

Format (the challenge's): header `id,embedding`, then one row per test caption `id,"[f1, f2, ..., fD]"`.
Values are written as float32 with 9 significant digits, which round-trips every float32 exactly.
"""
from __future__ import annotations

import numpy as np

from latentsweep.trainers.data.sets import load_answers
from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, leaderboard_from_ordered

HEADER = "id,embedding"
ID_MIN, ID_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
# 9 significant digits are enough to round-trip any float32 (IEEE 754: ceil(24*log10(2)) + 1 = 9).
FLOAT_FORMAT = "%.9g"
# How many offending ids an error message lists.
SHOW_FIRST = 5


def _row_vector(row) -> np.ndarray:
    if hasattr(row, "detach"):  # torch tensor, possibly on an accelerator
        row = row.detach().cpu().numpy()
    return np.asarray(row, dtype=np.float32)


def _write_rows(f, path: str, ids, embeddings) -> int:
    """Write validated rows to the open file f; returns the row count."""
    seen: set[int] = set()
    dim = None
    fmt = ""
    id_iter, emb_iter = iter(ids), iter(embeddings)
    n = 0
    for row_id in id_iter:
        try:
            row = _row_vector(next(emb_iter))
        except StopIteration:
            raise DataError(f"{path}: more ids than embedding rows (ran out at row {n})") from None
        row_id = int(row_id)
        if row.ndim != 1 or (dim is not None and row.shape[0] != dim):
            raise DataError(f"{path}: row {n} (id {row_id}): embedding shape {row.shape}, expected ({dim or 'D'},)")
        if dim is None:
            dim = row.shape[0]
            fmt = '%d,"[' + ", ".join([FLOAT_FORMAT] * dim) + ']"\n'
        if not np.isfinite(row).all():
            raise DataError(f"{path}: row {n} (id {row_id}): non-finite embedding value")
        if row_id in seen:
            raise DataError(f"{path}: row {n}: duplicate id {row_id}")
        seen.add(row_id)
        f.write(fmt % (row_id, *row.tolist()))
        n += 1
    if next(emb_iter, None) is not None:
        raise DataError(f"{path}: more embedding rows than ids ({n} ids)")
    if n == 0:
        raise DataError(f"{path}: no rows to write")
    return n


def write_submission(path, ids, embeddings) -> int:
    """Write the CSV atomically (latentsweep.trainers.core.io.atomic_write: a temporary file beside it, fsync,
    os.replace).

    ids: iterable of ints [N]; embeddings: array / tensor [N, D] or any iterable of N rows (a generator works).
    On any error (non-finite value, inconsistent dim, duplicate id, count mismatch, an exception from the iterable)
    the temporary file is removed and an existing file at `path` is left untouched. Returns the row count.
    """
    path = str(path)
    with atomic_write(path, "w", parents=False, encoding="utf-8", newline="") as f:
        f.write(HEADER + "\n")
        return _write_rows(f, path, ids, embeddings)


def _parse_values(path: str, lineno: int, text: str) -> list[float]:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1].strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise DataError(f"{path}: line {lineno}: embedding must be a quoted list \"[f1, f2, ...]\", got {text[:40]!r}")
    parts = text[1:-1].split(",")
    try:
        return [float(x) for x in parts]
    except ValueError:
        bad = next(x for x in parts if not _is_float(x))
        raise DataError(f"{path}: line {lineno}: value {bad.strip()[:40]!r} is not a number") from None


def _is_float(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True


def _parse(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64 [N], embeddings float32 [N, D], line numbers int64 [N]) of a submission file; the file's text and
    lines, freed, are handed back to the OS (about 0.1 GB that glibc kept resident at 5,000 x 1536 values)."""
    parsed = _read_rows(str(path))
    release_free_heap()
    return parsed


def _read_rows(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_parse`'s reading and checking, line by line."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: submission file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read submission ({exc.__class__.__name__}: {exc})") from None
    if not lines or lines[0].replace(" ", "") != HEADER:
        got = lines[0][:40] if lines else ""
        raise DataError(f"{path}: line 1: header must be {HEADER!r}, got {got!r}")
    ids, rows, where = [], [], []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # blank lines (e.g. a trailing one) carry nothing
        head, sep, rest = line.partition(",")
        if not sep:
            raise DataError(f"{path}: line {lineno}: expected 'id,\"[...]\"', got {line[:40]!r}")
        try:
            if "_" in head:  # int() reads Python's digit grouping: "0_1" would silently be id 1
                raise ValueError
            row_id = int(head.strip())
        except ValueError:
            raise DataError(f"{path}: line {lineno}: id {head.strip()[:40]!r} is not an integer") from None
        if not ID_MIN <= row_id <= ID_MAX:  # ids are int64 in every data file; larger ones would overflow
            raise DataError(f"{path}: line {lineno}: id {head.strip()[:40]} is outside the int64 range")
        ids.append(row_id)
        values = _parse_values(path, lineno, rest)
        if rows and len(values) != len(rows[0]):
            raise DataError(f"{path}: line {lineno}: {len(values)} values, expected {len(rows[0])} "
                            f"(as on line {where[0]})")
        rows.append(np.array(values, dtype=np.float32))  # float32 now: as Python floats, 0.25 GB at 5,000 x 1536
        where.append(lineno)
    if not rows:
        raise DataError(f"{path}: no rows after the header")
    return np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.float32), np.asarray(where, dtype=np.int64)


def read_submission(path) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [N], embeddings float32 [N, D]) in file order; DataError naming file and line if malformed."""
    ids, emb, _ = _parse(path)
    return ids, emb


def _list_first_few(values) -> str:
    values = list(values)
    return ", ".join(str(v) for v in values[:SHOW_FIRST]) + (", ..." if len(values) > SHOW_FIRST else "")


def _check_rows(path: str, ids, emb, lines, expected_ids, source: str, dim: int | None) -> None:
    """Every expected id exactly once, no other id, the right dim, finite values; else one-line DataError."""
    uniq, counts = np.unique(ids, return_counts=True)
    expected = np.unique(np.asarray(expected_ids, dtype=np.int64))
    problems = []
    missing = np.setdiff1d(expected, uniq)
    if missing.size:
        problems.append(f"{missing.size} missing (first: {_list_first_few(missing)})")
    dup = uniq[counts > 1]
    if dup.size:
        problems.append(f"{dup.size} duplicated (first: {_list_first_few(dup)}; id {dup[0]} on lines "
                        f"{_list_first_few(lines[ids == dup[0]])})")
    extra = np.setdiff1d(uniq, expected)
    if extra.size:
        problems.append(f"{extra.size} not in {source} (first: {_list_first_few(extra)})")
    if problems:
        raise DataError(f"{path}: ids do not match {source}: " + "; ".join(problems))
    if dim is not None and emb.shape[1] != dim:
        raise DataError(f"{path}: embeddings have dim {emb.shape[1]}, expected {dim}")
    bad = np.flatnonzero(~np.isfinite(emb).all(axis=1))
    if bad.size:
        raise DataError(f"{path}: line {lines[bad[0]]} (id {ids[bad[0]]}): non-finite embedding value "
                        f"({bad.size} such rows)")


def check_submission(path, test, dim: int | None = None) -> tuple[int, int]:
    """Validate a submission against a TestSet (uses test.ids): every test id exactly once, the same dim on every
    row (and == dim if given), finite values. Raises DataError with one line; returns (rows, dim)."""
    ids, emb, lines = _parse(path)
    source = f"test set {getattr(test, 'path', '')}".rstrip()
    _check_rows(str(path), ids, emb, lines, test.ids, source, dim)
    return int(emb.shape[0]), int(emb.shape[1])


def score_submission(path, answers_path, gallery_size: int = GALLERY_SIZE) -> dict[str, float]:
    """Score a submission with the leaderboard protocol: captions sorted by id, consecutive chunks of `gallery_size`,
    each caption ranked against the true images of its chunk. Returns the `latentsweep.trainers.eval.metrics.summarize` dict."""
    if isinstance(gallery_size, bool) or not isinstance(gallery_size, int) or gallery_size < 2:
        raise DataError(f"gallery size must be a whole number >= 2 (a gallery ranks images against each other), "
                        f"got {gallery_size!r}")
    ans_ids, ans_img = load_answers(answers_path)
    ans_ids = np.asarray(ans_ids, dtype=np.int64)
    if np.unique(ans_ids).size != ans_ids.size:
        raise DataError(f"{answers_path}: key 'captions/ids' has duplicate ids")
    ids, emb, lines = _parse(path)
    _check_rows(str(path), ids, emb, lines, ans_ids, f"answers {answers_path}", int(np.asarray(ans_img).shape[1]))
    pred = emb[np.argsort(ids, kind="stable")]                         # [N, D] in id order
    truth = np.asarray(ans_img, dtype=np.float32)[np.argsort(ans_ids, kind="stable")]
    return leaderboard_from_ordered(pred, truth, gallery_size=gallery_size)


__all__ = ["write_submission", "read_submission", "check_submission", "score_submission", "HEADER"]
