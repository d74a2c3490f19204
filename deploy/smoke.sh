#!/usr/bin/env bash
# Compose smoke test, one command: build (or reuse) the images, bring up PostgreSQL, MLflow, optuna-dashboard,
# create-study and 3 workers on a tiny study (deploy/smoke/smoke.toml), wait until every worker is in the middle of a
# trial, SIGKILL one worker container, let the others finish the study, then check that the trial budget is exact,
# nothing is left RUNNING in Optuna or MLflow, and the tracking server has a run for every trial. Prints a summary,
# exits non-zero on any failure, and tears the stack down (volumes included) either way.
#
#   deploy/smoke.sh
#
# It adapts to the engine: without a `bridge` network it adds deploy/compose.hostnet.yml (host networking); when
# python:3.11-slim cannot be pulled it builds the images from Debian packages (deploy/base-image.sh,
# deploy/compose.offline.yml). See deploy/README.md. Environment (all optional):
#   SMOKE_NETWORK=bridge|host   SMOKE_IMAGES=registry|debian   SMOKE_BUILD=0 (reuse the images as they are)
#   SMOKE_KEEP=1 (leave the stack up)   SMOKE_TIMEOUT=seconds (whole run after the build; default 1500)
#   SMOKE_PROJECT (compose project name, default latentsweep-smoke)   TORCH_INDEX, BASE_IMAGE, LATENTSWEEP_IMAGE
set -euo pipefail
cd "$(dirname "$0")/.."

STUDY=smoke
WORKERS=3
PROJECT=${SMOKE_PROJECT:-latentsweep-smoke}
TIMEOUT=${SMOKE_TIMEOUT:-1500}
N_TRIALS=$(sed -n 's/^n_trials *= *\([0-9]*\).*/\1/p' "deploy/smoke/$STUDY.toml")

say() { printf 'smoke: %s\n' "$*"; }
die() { say "FAILED: $*"; exit 1; }

# ---- what this host lacks, all in one line, before anything is built -----------------------------------------------
LACKS=()
if ! command -v docker >/dev/null 2>&1; then
    LACKS+=("docker (apt-get install docker.io)")
elif ! docker info >/dev/null 2>&1; then
    LACKS+=("a Docker engine that answers (start dockerd)")
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE_CLI=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE_CLI=(docker-compose)
else
    LACKS+=("Docker Compose (the docker compose plugin, or apt-get install docker-compose)")
fi
# The offline path (Debian-built images) makes its base image with debootstrap, unless it exists or nothing is built.
needs_debootstrap() {
    [ "${SMOKE_IMAGES:-debian}" = debian ] && [ "${SMOKE_BUILD:-1}" != 0 ] \
        && ! docker image inspect "${BASE_IMAGE:-latentsweep-base:bookworm}" >/dev/null 2>&1
}
lacks_debootstrap() { needs_debootstrap && ! command -v debootstrap >/dev/null 2>&1; }
DEBOOTSTRAP_LACK="debootstrap (apt-get install debootstrap; the offline path builds its Debian base image with it)"
if [ "${#LACKS[@]}" -gt 0 ]; then
    # without an engine the image source is unknown: name debootstrap too if the offline path would need it
    lacks_debootstrap && LACKS+=("$DEBOOTSTRAP_LACK")
    die "this host lacks: $(IFS=';'; printf '%s' "${LACKS[*]}" | sed 's/;/; /g')"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/latentsweep-smoke.XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS" "$WORK/data"

# ---- how this engine can run the stack ------------------------------------------------------------------------------
files=(-f docker-compose.yml)
if [ -z "${SMOKE_NETWORK:-}" ]; then
    if docker network inspect bridge >/dev/null 2>&1; then SMOKE_NETWORK=bridge; else SMOKE_NETWORK=host; fi
fi
[ "$SMOKE_NETWORK" = host ] && files+=(-f deploy/compose.hostnet.yml)

if [ -z "${SMOKE_IMAGES:-}" ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1 \
        || timeout 120 docker pull python:3.11-slim >"$LOGS/pull.log" 2>&1; then
        SMOKE_IMAGES=registry
    else
        SMOKE_IMAGES=debian
    fi
fi
if [ "$SMOKE_IMAGES" = debian ]; then
    if lacks_debootstrap; then rm -rf "$WORK"; die "this host lacks: $DEBOOTSTRAP_LACK"; fi
    files+=(-f deploy/compose.offline.yml)
    BASE_IMAGE=${BASE_IMAGE:-latentsweep-base:bookworm}
else
    BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
fi

# Build-only pip settings of this machine (CA bundle, local wheels), if it has any: deploy/build-env/README.md.
deploy/build-env.sh >"$LOGS/build-env.log"
if [ -z "${TORCH_INDEX:-}" ] && grep -qs '^torch==' deploy/build-env/constraints.txt; then
    # torch is pinned to a local wheel: its dependencies come from PyPI, not from the torch index
    TORCH_INDEX=https://pypi.org/simple
fi

# ---- the stack's settings: a fresh password, free ports, short heartbeats ------------------------------------------
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
    local port=$1
    while port_busy "$port"; do port=$((port + 1)); done
    echo "$port"
}
ENV_FILE=$WORK/smoke.env
cat >"$ENV_FILE" <<EOF
POSTGRES_USER=latentsweep
POSTGRES_PASSWORD=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
POSTGRES_DB=optuna
POSTGRES_PORT=$(free_port 15432)
POSTGRES_MAX_CONNECTIONS=50
POSTGRES_IMAGE=postgres:16
STUDY=$STUDY
STUDIES_DIR=./deploy/smoke
DATA_DIR=$WORK/data
BIND_ADDRESS=127.0.0.1
MLFLOW_PORT=$(free_port 15000)
DASHBOARD_PORT=$(free_port 18080)
MLFLOW_ALLOWED_HOSTS=mlflow,mlflow:*,localhost,localhost:*,127.0.0.1,127.0.0.1:*
MLFLOW_WORKERS=1
WORKER_THREADS=1
WORKER_HEARTBEAT=2
WORKER_GRACE=10
LATENTSWEEP_IMAGE=${LATENTSWEEP_IMAGE:-latentsweep:local}
BASE_IMAGE=$BASE_IMAGE
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
EOF
set -a
# shellcheck disable=SC1090  # the variables win over any the caller exported (compose prefers the environment)
. "$ENV_FILE"
set +a
say "compose: ${COMPOSE_CLI[*]} $("${COMPOSE_CLI[@]}" version --short 2>/dev/null || echo '?'); ${files[*]}"
if [ "$SMOKE_NETWORK" = host ]; then
    # docker-compose 1.x refuses published ports with host networking, and an override cannot delete them
    "${COMPOSE_CLI[@]}" -p "$PROJECT" --env-file "$ENV_FILE" "${files[@]}" config \
        | deploy/drop-ports.sh >"$WORK/compose.yml"
    files=(-f "$WORK/compose.yml")
    say "host networking: config rendered without ports (deploy/drop-ports.sh) to $WORK/compose.yml"
fi
COMPOSE=("${COMPOSE_CLI[@]}" -p "$PROJECT" --env-file "$ENV_FILE" "${files[@]}")
say "network: $SMOKE_NETWORK; images: $SMOKE_IMAGES (BASE_IMAGE=$BASE_IMAGE, TORCH_INDEX=$TORCH_INDEX)"
say "logs: $LOGS"

teardown() {
    local rc=$?
    if [ "$rc" != 0 ]; then
        "${COMPOSE[@]}" logs --no-color >"$LOGS/compose.log" 2>&1 || true
        say "last log lines (all in $LOGS/compose.log):"
        tail -n 40 "$LOGS/compose.log" | sed 's/^/  /'
    fi
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then
        say "SMOKE_KEEP=1: stack left up; stop it with: ${COMPOSE[*]} down -v"
    else
        "${COMPOSE[@]}" down -v --remove-orphans >"$LOGS/down.log" 2>&1 || say "teardown failed: $LOGS/down.log"
        rm -rf "$WORK/data" "$WORK/compose.yml" "$ENV_FILE"  # both hold the password
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# ---- build ----------------------------------------------------------------------------------------------------------
T0=$(date +%s)
if [ "${SMOKE_BUILD:-1}" != 0 ]; then
    if [ "$SMOKE_IMAGES" = debian ]; then
        deploy/base-image.sh "$BASE_IMAGE" >"$LOGS/base-image.log" 2>&1 || die "base image: see $LOGS/base-image.log"
        "${COMPOSE[@]}" build postgres >"$LOGS/build-postgres.log" 2>&1 || die "postgres image: $LOGS/build-postgres.log"
    fi
    # The services of the project image share one image name: building one builds it for all.
    "${COMPOSE[@]}" build mlflow >"$LOGS/build.log" 2>&1 || die "project image: see $LOGS/build.log"
fi
say "images ready ($(( $(date +%s) - T0 )) s): $LATENTSWEEP_IMAGE, $("${COMPOSE[@]}" config | sed -n 's/^ *image: *\(.*postgres.*\)/\1/p' | head -n 1)"

# ---- up -------------------------------------------------------------------------------------------------------------
T0=$(date +%s)
DEADLINE=$((T0 + TIMEOUT))
"${COMPOSE[@]}" up -d --scale "worker=$WORKERS" >"$LOGS/up.log" 2>&1 || die "compose up: see $LOGS/up.log"
cid() { "${COMPOSE[@]}" ps -q "$1"; }
MLFLOW_CID=$(cid mlflow)
mapfile -t WORKER_CIDS < <(cid worker)
[ "${#WORKER_CIDS[@]}" = "$WORKERS" ] || die "expected $WORKERS worker containers, got ${#WORKER_CIDS[@]}"
say "up in $(( $(date +%s) - T0 )) s: postgres, mlflow, dashboard, create-study (done), $WORKERS workers"

in_stack() {  # python code from stdin, run in the mlflow container (the project's Python and the PG* credentials)
    docker exec -i "$MLFLOW_CID" python - "$@"
}
http_status() {  # first line of an HTTP answer from 127.0.0.1:PORT, with bash alone (no curl needed)
    local answer
    answer=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$2" >&3 \
        && timeout 20 cat <&3) 2>/dev/null) || true
    printf '%s' "$answer"
}

# ---- wait until every worker is in the middle of a trial, then SIGKILL one ------------------------------------------
while :; do
    line=$(in_stack poll "$STUDY" <deploy/smoke_check.py 2>>"$LOGS/poll.err") || line='{}'
    mid=$(printf '%s' "$line" | sed -n 's/.*"running_past_first_epoch": \([0-9]*\).*/\1/p')
    [ "${mid:-0}" -ge "$WORKERS" ] && break
    for c in "${WORKER_CIDS[@]}"; do
        [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ] || die "worker $c exited before the kill: $line"
    done
    [ "$(date +%s)" -lt "$DEADLINE" ] || die "timed out waiting for $WORKERS trials in progress: $line"
    sleep 2
done
VICTIM=${WORKER_CIDS[1]}
VICTIM_NAME=$(docker inspect -f '{{.Name}}' "$VICTIM" | tr -d /)
docker kill --signal KILL "$VICTIM" >/dev/null
say "trials in progress: $line"
say "killed $VICTIM_NAME with SIGKILL $(( $(date +%s) - T0 )) s after up, in the middle of a trial"

# ---- the other workers finish the study (they reap the dead trial after WORKER_GRACE s and run its retry) ----------
for c in "${WORKER_CIDS[@]}"; do
    [ "$c" = "$VICTIM" ] && continue
    left=$((DEADLINE - $(date +%s)))
    [ "$left" -gt 0 ] && code=$(timeout "$left" docker wait "$c") || die "timed out waiting for worker $c to finish"
    restarts=$(docker inspect -f '{{.RestartCount}}' "$c")
    [ "$code" = 0 ] && [ "$restarts" = 0 ] || die "worker $c exited with $code after $restarts restarts"
done
victim_code=$(docker inspect -f '{{.State.ExitCode}} restarts={{.RestartCount}}' "$VICTIM")
say "surviving workers exited 0 after $(( $(date +%s) - T0 )) s; killed worker: exit $victim_code"

# ---- checks ---------------------------------------------------------------------------------------------------------
failed=0
mlflow_health=$(http_status "$MLFLOW_PORT" /health | head -n 1 | tr -d '\r')
dashboard=$(http_status "$DASHBOARD_PORT" /api/studies)
say "mlflow server on 127.0.0.1:$MLFLOW_PORT: ${mlflow_health:-no answer}"
if printf '%s' "$dashboard" | grep -q "\"study_name\": *\"$STUDY\""; then
    say "optuna-dashboard on 127.0.0.1:$DASHBOARD_PORT: $(printf '%s' "$dashboard" | head -n 1 | tr -d '\r'), lists study '$STUDY'"
else
    say "FAIL: optuna-dashboard on 127.0.0.1:$DASHBOARD_PORT does not list study '$STUDY'"
    failed=1
fi
case $mlflow_health in *" 200 "*) ;; *) failed=1 ;; esac
in_stack check "$STUDY" "$N_TRIALS" "http://mlflow:$MLFLOW_PORT" <deploy/smoke_check.py | sed 's/^/smoke: /' \
    || failed=1  # pipefail: the checks' exit status

if [ "$failed" = 0 ]; then
    say "PASSED: $N_TRIALS-trial budget exact with 1 of $WORKERS workers SIGKILLed mid-trial ($(( $(date +%s) - T0 )) s)"
else
    die "see the lines above"
fi
