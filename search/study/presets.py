"""Bundled study files (presets): found in a clone (`studies/`) and in an installed wheel (`search/studies/`), by name.

One directory holds them all, so a preset's `[[enqueue]] recipe = "other.toml"` resolves beside it in both cases.
pyproject.toml maps the top-level `studies/` folder to the package data directory `search/studies` of the wheel.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from latentsweep.trainers.core.errors import ConfigError, closest

_HERE = Path(__file__).resolve().parent
# Installed: search/studies beside search/study; a clone (editable or PYTHONPATH): the repository's studies/.
_CANDIDATES = (_HERE.parent / "studies", _HERE.parents[1] / "studies")


def presets_dir() -> Path:
    """The directory of the bundled study files."""
    for directory in _CANDIDATES:
        if directory.is_dir() and any(directory.glob("*.toml")):
            return directory
    raise ConfigError(f"no bundled study files found (looked in {', '.join(map(str, _CANDIDATES))}); "
                      f"the installation is incomplete")


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


def presets() -> list[tuple[str, str]]:
    """(name, description) of every bundled study file, by name."""
    out = []
    for name in preset_names():
        try:
            with open(presets_dir() / f"{name}.toml", "rb") as fh:
                description = str(tomllib.load(fh).get("study", {}).get("description", ""))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            description = f"(unreadable: {exc})"
        out.append((name, description))
    return out


def is_preset_name(arg: str) -> bool:
    """A bare name (no directory part), with or without .toml: what may name a preset."""
    return "/" not in arg and "\\" not in arg and bool(arg.removesuffix(".toml"))


def resolve_study_path(arg: str | Path) -> Path:
    """A study file path as given when it exists, else the preset of that name (`full` or `full.toml`); a name that
    is neither fails in one line naming the closest preset."""
    path = Path(arg).expanduser()
    if path.is_file() or not is_preset_name(str(arg)):
        return path  # a path (missing ones fail where they are read, naming the path)
    name = str(arg).removesuffix(".toml")
    if name in preset_names():
        return presets_dir() / f"{name}.toml"
    raise ConfigError(f"{arg}: no such study file and no preset of that name{closest(name, preset_names())}; "
                      f"presets: {', '.join(preset_names())} (latentsweep study presets)")


def referenced_recipes(path: Path) -> list[str]:
    """The other study files a study file's `[[enqueue]] recipe = ...` entries read (beside it)."""
    with open(path, "rb") as fh:
        entries = tomllib.load(fh).get("enqueue", [])
    names = [str(e["recipe"]) for e in entries if isinstance(e, dict) and "recipe" in e]
    return sorted({n for n in names if n != path.name})


def init_preset(name: str, dest: str | Path, force: bool = False) -> list[Path]:
    """Copy preset `name` to `dest` (a file, or a directory: DEST/NAME.toml) with the recipes it enqueues beside it,
    so the copy loads on its own (its own recipe, `recipe = "NAME.toml"`, renamed to the copy); returns the files
    written. An existing different file is kept unless `force`."""
    stem = name.removesuffix(".toml")
    if not is_preset_name(name) or stem not in preset_names():  # a preset by name, whatever files are here
        raise ConfigError(f"{name}: not a preset{closest(stem, preset_names())}; presets: "
                          f"{', '.join(preset_names())}")
    source = presets_dir() / f"{stem}.toml"
    dest = Path(dest).expanduser()
    target = dest / source.name if dest.is_dir() else dest
    if target.suffix != ".toml":
        raise ConfigError(f"{target}: a study file is a .toml file")
    if target.name in referenced_recipes(source):  # the copy would enqueue itself in the recipe's place
        raise ConfigError(f"{target}: preset {stem} enqueues the recipe {target.name}, which is copied beside it "
                          f"under that name; choose another file name")
    own = re.compile(r'(recipe\s*=\s*)"' + re.escape(source.name) + '"')
    plan = [(target, own.sub(lambda m: f'{m.group(1)}"{target.name}"', source.read_text()))]
    plan += [(target.parent / r, (source.parent / r).read_text()) for r in referenced_recipes(source)
             if r != target.name]
    for dst, text in plan:
        if dst.exists() and not force and dst.read_text() != text:
            raise ConfigError(f"{dst}: exists and differs from the preset's copy; pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    for dst, text in plan:
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
    return [dst for dst, _ in plan]
