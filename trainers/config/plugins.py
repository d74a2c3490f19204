"""User plugins: one Python file that registers a loss or a model (with its knobs) into the trainer's registries.

A plugin is loaded by path and identified by the sha256 of its bytes; a config carries `plugins.files` entries
`PATH#sha256=HEX`, so whoever rebuilds the config (a study worker, pick's refits and fold jobs, a checkpoint load)
loads the same file first and refuses a different one. Loading is once per process per file; any problem (an import
error, a knob that clashes with a built-in, a config section without defaults) is one line naming the file and line.
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import traceback
from pathlib import Path

from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.config.registry import transaction

_SEP = "#sha256="
_LOADED: dict[str, Path] = {}  # sha256 -> the file loaded with it (this process)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ref(path: Path, sha: str) -> str:
    """The `plugins.files` entry of a plugin file."""
    return f"{path}{_SEP}{sha}"


def parse_ref(entry: str) -> tuple[Path, str | None]:
    path, sep, sha = str(entry).partition(_SEP)
    return Path(path), (sha if sep else None)


def load_plugin(path: str | Path, expected_sha: str | None = None) -> str:
    """Import the plugin file (its registrations run) unless this process has already; returns its ref."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        loaded = _LOADED.get(expected_sha or "")
        if loaded is not None:  # the same bytes are already loaded here (from another path: another machine's)
            return ref(path, expected_sha)
        raise ConfigError(f"{path}: plugin file not found (the config was made with it; put the same file there)")
    sha = sha256_of(path)
    if expected_sha is not None and sha != expected_sha:
        raise ConfigError(f"{path}: plugin file changed since the config was made (sha256 {sha[:12]}..., "
                          f"expected {expected_sha[:12]}...): restore that file or start a new study")
    if sha in _LOADED:
        return ref(path, sha)
    clash = [p for p in _LOADED.values() if p == path]
    if clash:
        raise ConfigError(f"{path}: plugin file changed while this process had it loaded; restart to load it again")
    _import(path, sha)
    _LOADED[sha] = path
    return ref(path, sha)


def load_refs(entries) -> None:
    """Load every `plugins.files` entry (`PATH#sha256=HEX`) of a config, checking each file's hash."""
    for entry in entries or ():
        path, sha = parse_ref(entry)
        load_plugin(path, sha)


def _import(path: Path, sha: str) -> None:
    name = "latentsweep_plugin_" + re.sub(r"\W", "_", path.stem) + "_" + sha[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and torch look a class's module up by name
    try:
        with transaction():  # a failed import takes back what it registered: the fixed file loads in this process
            spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - anything user code raises (sys.exit and Ctrl-C too): one line
        del sys.modules[name]
        raise ConfigError(f"{_where(exc, path)}: {_describe(exc)}") from None


def _where(exc: BaseException, path: Path) -> str:
    """FILE:LINE of the deepest frame of the traceback inside the plugin file (a SyntaxError's own line)."""
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).resolve() == path:
        return f"{path}:{exc.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path]
    return f"{path}:{lines[-1]}" if lines else str(path)


def _describe(exc: BaseException) -> str:
    """What went wrong, in a line: an exit or an interrupt is said as such (it is not the command's own)."""
    if isinstance(exc, SystemExit):
        return f"the plugin called sys.exit({exc.code!r}) while it was imported"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt while the plugin was imported (interrupted, or raised by the plugin)"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return (text.strip().splitlines() or [""])[0][:300]
