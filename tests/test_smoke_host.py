"""deploy/smoke.sh's host check: with a tool missing from PATH it says, in one line and before building anything,
what the host lacks (a fake `docker` stands in for the engine; no Docker is needed)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# An engine that answers, has no bridge network, no images, and cannot pull: smoke.sh picks the offline path.
FAKE_DOCKER = """#!/bin/sh
case "$1 $2" in
    "compose version"|"info "*) exit 0 ;;
esac
exit 1
"""


def _path_without(tmp_path: Path, *tools: str) -> list[str]:
    """A PATH with every program of this one except `tools` (links in one directory: dropping whole directories
    would drop bash and coreutils with them where docker-compose or debootstrap live in /usr/bin)."""
    bin_dir = tmp_path / "path-bin"
    bin_dir.mkdir(exist_ok=True)
    for d in filter(None, os.environ["PATH"].split(os.pathsep)):
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = bin_dir / entry.name
            if entry.name not in tools and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return [str(bin_dir)]


def _smoke(tmp_path: Path, path_dirs: list[str], **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": os.pathsep.join(path_dirs), "TMPDIR": str(tmp_path), **env}
    return subprocess.run([shutil.which("bash"), str(ROOT / "deploy" / "smoke.sh")], env=full_env,
                          capture_output=True, text=True, timeout=60)


def _lacks_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stdout.splitlines() if "this host lacks:" in line]


def test_offline_path_without_debootstrap_says_so(tmp_path):
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "docker").write_text(FAKE_DOCKER)
    (fake / "docker").chmod(0o755)
    run = _smoke(tmp_path, [str(fake), *_path_without(tmp_path, "debootstrap", "docker", "docker-compose")])
    assert run.returncode != 0
    assert _lacks_lines(run) == ["smoke: FAILED: this host lacks: debootstrap (apt-get install debootstrap; "
                                 "the offline path builds its Debian base image with it)"]
    assert not list(tmp_path.glob("latentsweep-smoke.*"))  # nothing was started or built


def test_no_docker_at_all_is_one_line_naming_everything(tmp_path):
    run = _smoke(tmp_path, _path_without(tmp_path, "debootstrap", "docker", "docker-compose"), SMOKE_IMAGES="debian")
    assert run.returncode != 0
    [line] = _lacks_lines(run)
    assert "docker (apt-get install docker.io)" in line and "Docker Compose" in line and "debootstrap" in line


def test_registry_path_does_not_ask_for_debootstrap(tmp_path):
    run = _smoke(tmp_path, _path_without(tmp_path, "debootstrap", "docker", "docker-compose"), SMOKE_IMAGES="registry")
    [line] = _lacks_lines(run)
    assert "docker" in line and "debootstrap" not in line
