"""The declared floors of pyproject's direct dependencies: print them as `name==floor` pins, or check an install."""
import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
EXTRAS = ("test",)  # the extras the check installs (demo is not needed by the tests it runs)
PINNED = "torch"  # only the pinned CPU wheel may be installed here (any other spec pulls GBs of CUDA packages)
SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.]*)$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors() -> dict[str, str]:
    """{name: floor} for every direct dependency and the checked extras; each must be written `name>=X`."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in EXTRAS:
        specs += project["optional-dependencies"][extra]
    out = {}
    for spec in specs:
        match = SPEC.match(spec.split(";")[0].strip())
        if match is None:
            sys.exit(f"floors: {spec!r} is not of the form name>=X: give it a floor the check can install")
        out[normalise(match.group(1))] = match.group(2)
    return out


def release(version: str) -> tuple[int, ...]:
    """2.13.0+cpu -> (2, 13, 0): enough to compare a local wheel with a floor."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check() -> int:
    """Every installed direct dependency is exactly at its floor (torch: at or above it)."""
    bad = []
    for name, floor in floors().items():
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            bad.append(f"{name}: not installed (floor {floor})")
            continue
        ok = release(got) >= release(floor) if name == PINNED else release(got) == release(floor)
        print(f"{name:18s} floor {floor:10s} installed {got}")
        if not ok:
            bad.append(f"{name}: installed {got}, floor {floor}")
    for line in bad:
        print(f"floors: {line}", file=sys.stderr)
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="check the running interpreter's installed versions")
    if parser.parse_args().check:
        return check()
    print("\n".join(f"{name}=={floor}" for name, floor in floors().items() if name != PINNED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
