#!/usr/bin/env bash
# Minimum-versions check: every direct dependency pinned to its pyproject floor (`name==floor`, made by .ci/floors.py;
# pip has no lowest-version resolution), then a fast subset of the tests. The venv reuses the suite's installs
# instead of downloading them again (minutes on 2 cores): a .pth line puts SUITE_VENV's site-packages (default
# .venv, made by the README's test command) on its path after its own, and pip installs into it only what the
# floors change: each pinned floor, and any transitive dependency a floor needs at another version. The rest
# (torch, the transitive dependencies a floor accepts) is the suite's. Torch is never pinned here (any spec but the
# installed CPU wheel pulls GBs of CUDA packages); its floor is derived from the APIs the code calls, which
# tests/test_torch_api.py names and checks.
# Usage: .ci/min_versions.sh [extra pytest args]   (MIN_VENV=DIR keeps the venv in DIR instead of a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."

suite="${SUITE_VENV:-.venv}"
suite_site="$("$suite/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ -n "${MIN_VENV:-}" ]]; then
    venv="$MIN_VENV"; rm -rf "$venv"
else
    venv="$(mktemp -d "${TMPDIR:-/tmp}/latentsweep-min.XXXXXX")"; trap 'rm -rf "$venv"' EXIT
fi
"$suite/bin/python" -m venv --without-pip "$venv"  # the suite's pip and setuptools too (below)
pip=("$venv/bin/python" -m pip)
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A directory named by a .pth line is not a site directory: its own .pth files (the suite's editable install of this
# checkout) do not run, so the editable install below is the only one.
echo "$suite_site" >"$site/suite-installs.pth"
pins="$venv/floors.txt"
"$suite/bin/python" .ci/floors.py >"$pins"
# Wheels only: a floor must install without a compiler (psycopg2-binary and psutil floors are the first with
# Python 3.11 wheels). pip leaves the suite's newer copies where they are ("outside environment") and installs the
# floors in front of them.
"${pip[@]}" install -q --only-binary :all: -r "$pins"
"${pip[@]}" install -q --no-deps --no-build-isolation -e .  # the suite's setuptools builds it
"${pip[@]}" check  # the installed set satisfies every declared requirement, ours included
"$venv/bin/python" .ci/floors.py --check  # and each direct dependency is exactly at its floor, first on the path

# The subset imports and exercises every direct dependency: the torch APIs, training, the config and study files,
# Optuna storage/heartbeat/retry, MLflow tracking, a pick's LoggedModel, the UI servers.
# -m: the slow tests of these files too (the UI servers' are slow-marked), which the suite's addopts leave out.
# Deselected: the two longest of test_study.py (Ctrl-C and a parallel budget: 30-40 s each on 2 cores), which test
# our signal and budget handling, not a dependency's API; the suite and the slow step run them.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not wheel and not nightly" \
    --deselect tests/test_study.py::test_ctrl_c_fails_trial_kills_run_and_resume_retries_it \
    --deselect tests/test_study.py::test_parallel_sqlite_workers_spend_exact_budget \
    tests/test_torch_api.py tests/test_rows.py tests/test_config.py tests/test_studyfile.py tests/test_space.py \
    tests/test_loop.py tests/test_optim.py tests/test_tracking.py tests/test_study.py tests/test_worker_exits.py \
    tests/test_tracking_e2e.py tests/test_ui.py "$@"
