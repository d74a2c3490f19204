"""The installed wheel works: built from this tree, installed into a fresh venv outside it, and run from an empty
directory (a preset study by name, pick, and a plugin example), as a user of the package would.

The venv reuses the suite's installs (torch and every dependency, pip and setuptools too) instead of downloading them
again (minutes on 2 cores): it is made without pip, a .pth line puts the suite's site-packages on its path after its
own, and the wheel goes in with --no-deps; `pip check` then proves that what the wheel declares is met by that set.
A directory named by a .pth line is not a site directory, so its own .pth files (the checkout's editable install) do
not run: the package imported is the wheel's."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(argv, cwd: Path, env: dict, timeout: int = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.wheel
def test_the_wheel_runs_a_preset_pick_and_a_plugin_from_an_empty_directory(tmp_path):
    # the user's environment: nothing of this checkout on the path, torch's own thread default
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VIRTUAL_ENV", "LATENTSWEEP_STATE_DIR")}
    started = time.monotonic()
    # built from a copy: setuptools' build/ cache in the checkout could carry files deleted since into the wheel
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "mlruns", "build", "dist", "runs",
                                                                "*.egg-info", "__pycache__", ".pytest_cache"))
    # the suite's setuptools builds it (pyproject's build-system floor; torch needs a newer one): no download
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".", "-w", tmp_path / "dist"],
        source, env)
    wheel, = (tmp_path / "dist").glob("latentsweep-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    site, = venv.glob("lib/python3*/site-packages")
    suite = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))  # this suite's installs
    (site / "suite-installs.pth").write_text("".join(f"{path}\n" for path in suite))
    pip = [venv / "bin" / "python", "-m", "pip"]  # the suite's pip, installing into this venv
    run([*pip, "install", "-q", "--no-deps", "--ignore-installed", wheel], tmp_path, env)
    run([*pip, "check"], tmp_path, env)  # every requirement the wheel declares is met
    installed = time.monotonic()

    empty = tmp_path / "empty"
    empty.mkdir()
    where = run([venv / "bin" / "python", "-c", "import latentsweep; print(latentsweep.__file__)"], empty, env)
    assert where.stdout.strip().startswith(str(venv))  # the installed package, not this checkout
    cli = venv / "bin" / "latentsweep"
    listed = run([cli, "study", "presets"], empty, env).stdout
    assert "quickstart" in listed and "full" in listed

    # the preset by name, on the demo data the wheel ships; 1 of its 12 trials (the pick's own paths are tested in the
    # suite: here, that an installed pick finds the study and writes its files)
    run([cli, "study", "run", "quickstart", "--n-trials", "1"], empty, env)
    run([cli, "pick", "quickstart"], empty, env)
    assert (empty / "mlruns" / "picks" / "quickstart" / "submission.csv").is_file()
    studied = time.monotonic()

    # a plugin example, as a user would bring it: the study file and its plugin side by side
    for name in ("siglip.toml", "siglip_loss.py"):
        (empty / name).write_bytes((ROOT / "examples" / name).read_bytes())
    study = (empty / "siglip.toml").read_text()
    assert "\nepochs = 8\n" in study  # 2 epochs are enough to load the plugin's loss and train with it
    (empty / "siglip.toml").write_text(study.replace("\nepochs = 8\n", "\nepochs = 2\n"))
    run([cli, "study", "run", "siglip.toml", "--n-trials", "1"], empty, env)  # one trial loads and trains the plugin
    run([cli, "study", "init", "full", "my_study.toml"], empty, env)
    assert (empty / "my_study.toml").is_file()
    print(f"\nwheel test: build+install {installed - started:.0f} s, quickstart+pick {studied - installed:.0f} s, "
          f"plugin study {time.monotonic() - studied:.0f} s")
