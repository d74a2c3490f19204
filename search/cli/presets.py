"""`latentsweep study presets|init`: the bundled study files, listed and copied out to edit."""
from __future__ import annotations

from pathlib import Path

from latentsweep.search.checks import check_outputs
from latentsweep.search.stores import default_protected
from latentsweep.search.study.presets import init_preset, presets, presets_dir


def add_actions(ssub) -> None:
    """The preset actions of `latentsweep study`, added to its subparsers."""
    listing = ssub.add_parser("presets", help="the bundled study files, runnable by name (study run NAME)")
    listing.add_argument("--path", action="store_true", help="print the directory that holds them")
    listing.set_defaults(func=cmd_study_presets)
    init = ssub.add_parser("init", help="copy a preset (and the recipes it enqueues) to a file to edit")
    init.add_argument("preset", help="preset name (see: latentsweep study presets)")
    init.add_argument("dest", nargs="?", default=".", help="file or directory to write (default: here, NAME.toml)")
    init.add_argument("--force", action="store_true", help="overwrite existing files that differ")
    init.set_defaults(func=cmd_study_init)


def cmd_study_presets(args) -> int:
    if args.path:
        print(presets_dir())
        return 0
    rows = presets()
    width = max(len(name) for name, _ in rows)
    for name, description in rows:
        print(f"{name:<{width}}  {description}")
    return 0


def cmd_study_init(args) -> int:
    dest = Path(args.dest).expanduser()
    target = dest / f"{args.preset.removesuffix('.toml')}.toml" if dest.is_dir() else dest
    check_outputs("DEST", [target], {}, default_protected())  # a study file never replaces a store or a checkpoint
    written = init_preset(args.preset, args.dest, force=args.force)
    print(f"wrote {written[0]}" + (f" (and the recipes it enqueues: {', '.join(p.name for p in written[1:])})"
                                   if written[1:] else ""))
    print(f"run it: latentsweep study run {written[0]}")
    return 0
