"""The documentation stays true to the tree: every relative link of README.md and docs/*.md points at something that
exists, every repository path they name in backticks exists, every module is in docs/layout.md, and the README stays
a short front page (at most 300 lines, none over 200 characters)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Pages linked before they are written may dangle while named here (none now: every linked page is in the tree).
PENDING_PAGES: set[str] = set()
# File names the docs mention that are the user's or generated, never in the tree.
NOT_IN_TREE = {"train.npz", "test.clean.npz", "answers.npz", "submission.csv", "optuna.db", "mlflow.db", "best.pt",
               "metrics.csv", "ensemble_weights.png", ".env", "my_study.toml", "docker-compose.override.yml",
               "siglip_loss.py#sha256=HEX"}
GENERATED_DIRS = ("mlruns/", "dist/", ".venv/", "search/studies")  # made by a run, a build or the wheel's mapping
EXTENSIONS = (".py", ".toml", ".md", ".yml", ".yaml", ".sh", ".json", ".npz", ".ipynb", ".cfg", ".txt", ".csv")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")


def tracked() -> set[str]:
    """The files git tracks, and the untracked ones it does not ignore (a helper's page not committed yet)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


FILES = tracked()
DIRS = {str(Path(f).parents[i]) for f in FILES for i in range(len(Path(f).parents) - 1)}
TOP = {f.split("/")[0] for f in FILES}
BASENAMES = {Path(f).name for f in FILES}


def exists(path: str) -> bool:
    path = path.rstrip("/")
    return path in FILES or path in DIRS


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_exist(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve().relative_to(ROOT).as_posix()
        if not exists(path) and path not in PENDING_PAGES:
            missing.append(target)
    assert missing == []


def named_paths(text: str):
    """Backticked words that look like repository paths: a top-level folder of the tree then a `/`, or a file name
    with a known extension. Globs, URLs, placeholders and dotted config keys are not paths."""
    for word in CODE.findall(text):
        word = word.rstrip(".,:;")
        if "://" in word or any(c in word for c in "*<>{}$=") or word.startswith(("-", "~")):
            continue
        first = word.split("/")[0]
        if ("/" in word and first in TOP) or word.endswith(EXTENSIONS):
            yield word


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_repository_paths_exist(page):
    missing = []
    for word in named_paths(page.read_text()):
        if word in NOT_IN_TREE or word.startswith(GENERATED_DIRS):
            continue
        found = exists(word) if "/" in word else word in BASENAMES
        if not found and word not in PENDING_PAGES:
            missing.append(word)
    assert missing == []


def test_path_finder_sees_paths_and_skips_the_rest():
    text = "`search/study/side.py` `full.toml` `val/mrr` `loss.targets` `studies/*.toml` `http://x/y.py` `a b`"
    assert list(named_paths(text)) == ["search/study/side.py", "full.toml"]


def test_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    # The two set-up commands stay verbatim (.ci/run runs the second exactly), whatever their length.
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert long == []


def test_ci_runs_exactly_the_readme_test_command():
    commands = [line for line in README.read_text().splitlines() if line.startswith("python3 -m venv ")]
    assert len(commands) == 2 and commands[1].endswith("&& .venv/bin/python -m pytest")
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def layout_sections() -> dict[str, set[str]]:
    """docs/layout.md: each `### `pkg/`` heading and the backticked names below it."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in (ROOT / "docs" / "layout.md").read_text().splitlines():
        heading = re.match(r"#+ `([^`]+/)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif current is not None:
            current.update(CODE.findall(line))
    return sections


def test_layout_names_every_module_in_its_package():
    sections = layout_sections()
    modules = sorted(f for f in FILES if f.endswith(".py") and f.split("/")[0] in ("search", "trainers")
                     and (ROOT / f).exists())
    missing = [m for m in modules if Path(m).name not in sections.get(str(Path(m).parent) + "/", set())]
    assert missing == []


def test_the_readme_links_every_docs_page():
    linked = {target.split("#")[0] for target in LINK.findall(README.read_text())}
    assert sorted(rel(p) for p in PAGES[1:] if rel(p) not in linked) == []
