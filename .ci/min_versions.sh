#!/usr/bin/env bash
# Minimum-versions check: every direct dependency pinned to its pyproject floor (`name==floor`, made by .ci/floors.py;
# pip has no lowest-version resolution), then a fast subset of the tests. The venv reuses the suite's installs
# instead of downloading them again (minutes on 2 cores): a .pth line puts SUITE_VENV's site-packages (default
# .venv, made by the README's test command) on its path after its own, and pip installs into it only what the
# floors change: each pinned floor, and any transitive dependency a floor needs at another version. The rest
# (torch, the transitive dependencies a floor accepts) is the suite's. Torch is never pinned here (any spec but the
# installed CPU wheel pulls GBs of CUDA packages); its floor is derived from the APIs the code calls, which
# tests/test_torch_api.py names and checks.
# The floors' venv is kept between runs, as pip keeps its cache, under a key of everything that decides what is
# installed into it: the pins, the interpreter and the suite's installed set (`pip freeze`, this checkout left out).
# A new key (a floor moved, a dependency released into the suite's set) builds it afresh and removes the old one;
# this checkout's install, pip check, floors.py --check and the tests run every time.
# Usage: .ci/min_versions.sh [extra pytest args]
#   MIN_VENV=DIR: a fresh venv in DIR, kept by no one; LATENTSWEEP_CI_CACHE=DIR: where the kept venv lives (default
#   ~/.cache/latentsweep-ci); a second run on the same cache waits for the first (flock).
set -euo pipefail
cd "$(dirname "$0")/.."

suite="${SUITE_VENV:-.venv}"
suite_site="$("$suite/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pins="$("$suite/bin/python" .ci/floors.py)"
if [[ -n "${MIN_VENV:-}" ]]; then
    venv="$MIN_VENV"; rm -rf "$venv"
else
    cache="${LATENTSWEEP_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/latentsweep-ci}"
    mkdir -p "$cache"
    exec 9>"$cache/lock" && flock 9  # this checkout is installed into the kept venv: one run at a time
    key="$({ echo "$pins"; "$suite/bin/python" -VV; "$suite/bin/python" -m pip freeze --exclude-editable; } \
           | sha256sum | cut -c1-16)"
    venv="$cache/floors-$key"
    if [[ ! -f "$venv/.complete" ]]; then  # absent, or a build that stopped half-way: the kept ones go
        find "$cache" -maxdepth 1 -name 'floors-*' -exec rm -rf {} +
    fi
fi
pip=("$venv/bin/python" -m pip)
if [[ -f "$venv/.complete" ]]; then
    echo "min_versions: the floors' venv kept from an earlier run ($venv)"
else
    "$suite/bin/python" -m venv --without-pip "$venv"  # the suite's pip and setuptools too (below)
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A directory named by a .pth line is not a site directory: its own .pth files (the suite's editable install of this
# checkout) do not run, so the editable install below is the only one. Written every run: this checkout's .venv.
echo "$suite_site" >"$site/suite-installs.pth"
if [[ ! -f "$venv/.complete" ]]; then
    # Wheels only: a floor must install without a compiler (psycopg2-binary and psutil floors are the first with
    # Python 3.11 wheels; isal's is the first whose inflate releases the GIL, a release after its first 3.11 wheel).
    # pip leaves the suite's newer copies where they are ("outside environment") and installs the floors in front of
    # them.
    echo "$pins" >"$venv/floors.txt"
    "${pip[@]}" install -q --only-binary :all: -r "$venv/floors.txt"
    touch "$venv/.complete"
fi
"${pip[@]}" install -q --no-deps --no-build-isolation -e .  # the suite's setuptools builds it
"${pip[@]}" check  # the installed set satisfies every declared requirement, ours included
"$venv/bin/python" .ci/floors.py --check  # and each direct dependency is exactly at its floor, first on the path

# The subset imports and exercises every direct dependency: the torch APIs, training, the config and study files,
# Optuna storage/heartbeat/retry, MLflow tracking, a pick's LoggedModel, the UI servers, isal's inflate (test_npz).
# -m: the slow tests of these files too (the UI servers' are slow-marked), which the suite's addopts leave out.
# Deselected: the two longest of test_study.py (Ctrl-C and a parallel budget: 30-40 s each on 2 cores), which test
# our signal and budget handling, not a dependency's API; the suite and the slow step run them.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not wheel and not nightly" \
    --deselect tests/test_study.py::test_ctrl_c_fails_trial_kills_run_and_resume_retries_it \
    --deselect tests/test_study.py::test_parallel_sqlite_workers_spend_exact_budget \
    tests/test_torch_api.py tests/test_rows.py tests/test_config.py tests/test_studyfile.py tests/test_space.py \
    tests/test_loop.py tests/test_optim.py tests/test_tracking.py tests/test_study.py tests/test_worker_exits.py \
    tests/test_tracking_e2e.py tests/test_ui.py tests/test_npz.py "$@"
