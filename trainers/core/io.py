"""Atomic file writes: the one home for "write beside, fsync, rename" used by every writer of results."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, parents: bool = True, **open_kwargs) -> Iterator[IO]:
    """An open file that replaces `path` atomically when the block ends cleanly (atomic_path).

    mode: "w" (text, default) or "wb"; open_kwargs go to `open` (encoding, newline). parents: create missing parent
    directories; False makes a missing directory an error (FileNotFoundError), as for `open`."""
    with atomic_path(path, parents=parents) as tmp, open(tmp, mode, **open_kwargs) as fh:
        yield fh


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, parents: bool = True) -> Iterator[Path]:
    """A temporary path beside `path` (same directory, so the rename cannot cross file systems) for a writer that
    takes a path (and for a check of what it wrote); on a clean exit its file is fsynced and `os.replace`d onto
    `path`. On any error (Ctrl-C included) the temporary file is removed and an existing file at `path` is left
    untouched: a reader or a crash never sees a half-written file. parents: as atomic_write's."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, _mode_for(path))  # mkstemp makes 0600; the result gets what `open` would have given it
        yield Path(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename == tmp:  # the user named `path`; the hidden temporary file means nothing to them
            exc.filename, exc.filename2 = str(path), None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync(name: str) -> None:
    """Flush a closed file's data to the disk (before the rename that publishes it)."""
    fd = os.open(name, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    """An existing file's permission bits, else 0o666 less the process umask (as `open` creates files)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without setting it (os.umask can only be read by changing it, which races threads);
    Linux reports it in /proc/self/status; elsewhere the common default 0o022."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
