#!/usr/bin/env bash
# Minimum-versions check: a fresh venv with every direct dependency pinned to its pyproject floor (`name==floor`,
# made by .ci/floors.py; pip has no lowest-version resolution), then a fast subset of the tests. Torch is the
# exception: only the pinned CPU wheel is installed here (any other spec pulls GBs of CUDA packages); its floor is
# derived from the APIs the code calls, which tests/test_torch_api.py names and checks.
# Usage: .ci/min_versions.sh [extra pytest args]   (MIN_VENV=DIR keeps the venv in DIR instead of a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${MIN_VENV:-}" ]]; then
    venv="$MIN_VENV"; rm -rf "$venv"
else
    venv="$(mktemp -d "${TMPDIR:-/tmp}/latentsweep-min.XXXXXX")"; trap 'rm -rf "$venv"' EXIT
fi
python3 -m venv "$venv"
pins="$venv/floors.txt"
python3 .ci/floors.py >"$pins"
"$venv/bin/pip" install -q torch==2.13.0
# Wheels only: a floor must install without a compiler (psycopg2-binary and psutil floors are the first with
# Python 3.11 wheels). Transitive dependencies resolve to what pip picks beside the pinned floors.
"$venv/bin/pip" install -q --only-binary :all: -r "$pins"
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" check  # the installed set satisfies every declared requirement, ours included
"$venv/bin/python" .ci/floors.py --check  # and each direct dependency is exactly at its floor

# The subset (~4 min on 2 cores) imports and exercises every direct dependency: the torch APIs, training, the config
# and study files, Optuna storage/heartbeat/retry, MLflow tracking, a pick's LoggedModel, the UI servers.
# -m: the slow tests of these files too (the UI servers' are slow-marked), which the suite's addopts leave out.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not wheel" \
    tests/test_torch_api.py tests/test_rows.py tests/test_config.py tests/test_studyfile.py tests/test_space.py \
    tests/test_loop.py tests/test_optim.py tests/test_tracking.py tests/test_study.py tests/test_worker_exits.py \
    tests/test_tracking_e2e.py tests/test_ui.py "$@"
