"""The documentation stays true to the tree and speaks to users only: every link of README.md and docs/*.md points at
something that exists, every anchor (`page.md#section`, `#section`) matches a heading of its page, every repository
path they name in backticks exists, no page names the machines or private paths the project is developed with, every
module is in docs/layout.md, and the README stays a short front page (at most 300 lines, none over 200 characters)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# File names the docs mention that are the user's or generated, never in the tree.
NOT_IN_TREE = {"train.npz", "test.clean.npz", "answers.npz", "submission.csv", "optuna.db", "mlflow.db", "best.pt",
               "metrics.csv", "ensemble_weights.png", ".env", "my_study.toml", "docker-compose.override.yml",
               "siglip_loss.py#sha256=HEX"}
GENERATED_DIRS = ("mlruns/", "dist/", ".venv/", "search/studies")  # made by a run, a build or the wheel's mapping
EXTENSIONS = (".py", ".toml", ".md", ".yml", ".yaml", ".sh", ".json", ".npz", ".ipynb", ".cfg", ".txt", ".csv")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# Words of the machines, paths and people the project is developed with: a user has none of them. A figure may say
# the machine it was measured on (cores, CPU, load), as its condition, but not point at our own setup.
PRIVATE = {
    r"\.\./shared\b": "a path outside the repository",
    r"(?<![\w$])/(tmp|work|home)/\w": "an absolute path of a development machine",
    r"project's machines": "the development machines",
    r"local CPU wheel": "the development machines' wheel",
    r"(?<!write's )\bsessions?\b": "a development session",
    r"\bother helpers\b|\bother engineers\b|\bthe lead\b": "the people developing the project",
    r"\blent\b": "a machine lent to the developers",
    r"\b(cores?|CPU|machine) here\b|\bthis 2-core\b|\bhere \(\d+ cores": "our machine, as 'here'",
    r"\$OUT\b": "a development tool's output folder",
}


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


def prose(text: str) -> list[str]:
    """The page's lines with fenced code blocks blanked (a `# comment` there is no heading, a `[x](y)` no link)."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def dead_links(page: Path, root: Path = ROOT, present=exists) -> list[str]:
    """The page's links that lead nowhere: a file outside `root` or absent (`present` says which paths are there),
    or an anchor that no heading of its page makes. Links with a scheme (https:, mailto:) are not fetched."""
    dead = []
    for target in (t for line in prose(page.read_text()) for t in LINK.findall(line)):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not resolved.is_relative_to(root.resolve()):
            dead.append(target)
            continue
        path = resolved.relative_to(root.resolve()).as_posix()
        if path_part and not present(path):
            dead.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            dead.append(target)
    return dead


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_and_anchors_resolve(page):
    assert dead_links(page) == []


def test_the_link_checker_catches_a_dead_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The `run` job: one budget\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Page\n\n## Real section\n\n```bash\n# not a heading\n[x](#not-a-heading)\n```\n\n"
                    "[ok](#real-section) [ok](other.md#the-run-job-one-budget) [ok](other.md#twice-1) [ok](other.md)"
                    " [ok](https://example.com/#x)\n[dead](#made-up-section) [dead](other.md#made-up)"
                    " [dead](other.md#twice-2) [dead](#not-a-heading) [dead](missing.md) [dead](../../outside.md)\n")
    assert dead_links(page, tmp_path, lambda path: (tmp_path / path).exists()) == [
        "#made-up-section", "other.md#made-up", "other.md#twice-2", "#not-a-heading", "missing.md",
        "../../outside.md"]


def test_slugs_are_githubs():
    assert slug("The one-budget job: `latentsweep run`") == "the-one-budget-job-latentsweep-run"
    assert slug("### `trainers/losses/`".lstrip("# ")) == "trainerslosses"
    assert slug("Round 6 (issue 39)") == "round-6-issue-39"
    assert slug("A [linked](x.md) **bold** word") == "a-linked-bold-word"


def private_words(text: str) -> list[str]:
    """Each phrase of PRIVATE the text holds, with why a user's doc may not say it."""
    return [f"{m.group(0)!r}: {why}" for pattern, why in PRIVATE.items()
            for m in re.finditer(pattern, text, re.IGNORECASE)]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_docs_name_no_development_machine(page):
    assert private_words(page.read_text()) == []


def test_private_words_are_caught():
    text = ("needs `../shared/seeds/`; a log at /tmp/team/x.log; takes the local CPU wheel on the project's machines; "
            "2 cores shared with five other sessions; no GPU was lent; measured on the CPU here")
    assert len(private_words(text)) == 7
    assert private_words("the write's session; a 2-core x86_64 CPU; $TMPDIR/latentsweep-data; this machine") == []


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
        if not found:
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
    assert len(commands) == 2 and commands[1].rsplit(" && ", 1)[1].startswith(".venv/bin/python -m pytest")
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
    modules = sorted(f for f in FILES if f.endswith(".py") and f.split("/")[0] in ("latentsweep", "search", "trainers")
                     and (ROOT / f).exists())
    missing = [m for m in modules if Path(m).name not in sections.get(str(Path(m).parent) + "/", set())]
    assert missing == []


def test_the_readme_links_every_docs_page():
    linked = {target.split("#")[0] for target in LINK.findall(README.read_text())}
    assert sorted(rel(p) for p in PAGES[1:] if rel(p) not in linked) == []
