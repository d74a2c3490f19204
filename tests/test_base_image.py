"""deploy/base-image.sh without Docker or a mirror: fake `debootstrap` and `docker` on PATH, and the tar stream the
script feeds to `docker import` read back with tarfile (the image's `/` must be usable by non-root processes)."""
from __future__ import annotations

import os
import stat
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# debootstrap --variant=minbase SUITE TARGET MIRROR: a two-file root file system instead of Debian
FAKE_DEBOOTSTRAP = """#!/bin/sh
mkdir -p "$3/etc/apt" "$3/usr/lib" "$3/var/cache/apt/archives" "$3/var/lib/apt/lists"
echo fake >"$3/usr/lib/libc.so.6"
"""
# docker image inspect: no such image; docker import ... - IMAGE: keep the stream it is fed
FAKE_DOCKER = """#!/bin/sh
case "$1" in
    image) exit 1 ;;
    import) cat >"$IMPORTED" ;;
esac
"""


def _fake_tools(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("debootstrap", FAKE_DEBOOTSTRAP), ("docker", FAKE_DOCKER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def test_imported_root_is_world_readable(tmp_path):
    _fake_tools(tmp_path / "bin")
    imported = tmp_path / "imported.tar"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "TMPDIR": str(scratch),
           "IMPORTED": str(imported), "DEBIAN_MIRROR": "http://mirror.invalid/debian"}
    run = subprocess.run(["sh", str(ROOT / "deploy" / "base-image.sh"), "test-base:x"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    with tarfile.open(imported) as tar:
        members = {m.name: m for m in tar.getmembers()}
    # `./` is the image's `/`: mktemp -d made it 0700, which locked every non-root process out of the image
    assert stat.S_IMODE(members["."].mode) == 0o755
    assert "./usr/lib/libc.so.6" in members and "./etc/apt/sources.list" in members
    assert list(scratch.iterdir()) == []  # the root file system and its log are removed
