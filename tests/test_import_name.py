"""One import name: `import latentsweep as ls` gives the API, and a user's own `search.py` or `trainers/` beside a
notebook changes nothing latentsweep imports; the repository's folder names are not import names of their own."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import latentsweep as ls, latentsweep.search.api as api, latentsweep.trainers.train.loop as loop, sys; "
         "assert all(getattr(ls, n) is getattr(api, n) for n in ls.API), 'the API is not re-exported'; "
         "print(loop.__file__); print(sorted(m for m in sys.modules if m.split('.')[0] in ('search', 'trainers')))")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_users_search_and_trainers_shadow_nothing(tmp_path):
    # A notebook's folder with modules of the same names as the repository's folders, each failing loudly if imported
    (tmp_path / "search.py").write_text("raise SystemExit('the user search.py was imported')\n")
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "__init__.py").write_text("raise SystemExit('the user trainers/ was imported')\n")
    proc = _python(PROBE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loop_file, top_level = proc.stdout.splitlines()
    assert not Path(loop_file).resolve().is_relative_to(tmp_path.resolve())
    assert top_level == "[]"  # nothing was imported under the bare names


def test_the_cli_runs_as_python_m_latentsweep(tmp_path):
    (tmp_path / "search.py").write_text("raise SystemExit('the user search.py was imported')\n")
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: latentsweep" in proc.stdout


def test_a_folder_name_is_not_an_import_name_of_its_own():
    # From the checkout's root the folders are importable by their bare names; that would be a second copy of every
    # module (two registries, two error classes): it fails at once, naming the one import name.
    for name in ("search", "trainers"):
        proc = _python(f"import {name}", ROOT)
        assert proc.returncode != 0
        assert "latentsweep" in proc.stderr.splitlines()[-1]
