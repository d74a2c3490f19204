"""Deployment files: docker-compose.yml (and its overrides in deploy/) validates, runs real CLI entry points, keeps
secrets in .env and the UIs on loopback; the Dockerfile can be built on a CUDA or a Debian base and keeps build-only
settings out of the image. No Docker engine is needed (deploy/smoke.sh runs the stack for real, by hand)."""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from latentsweep.search.cli.main import build_parser
from latentsweep.search.study.devices import env_defaults
from latentsweep.search.study.studyfile import load_study_file

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
HOSTNET = ROOT / "deploy" / "compose.hostnet.yml"
OFFLINE = ROOT / "deploy" / "compose.offline.yml"
ENV_EXAMPLE = ROOT / ".env.example"
UI_PORTS = {"mlflow": 5000, "dashboard": 8080}
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}; "$$" is a literal "$" (compose's escape)
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def read_env(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation over a parsed YAML tree (enough of it for these files)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$$"  # kept escaped, as `docker compose config` prints it
        name, op, arg = m["name"], m["op"], m["arg"]
        present = name in env and (env[name] != "" or not (op or "").startswith(":"))
        if op in ("?", ":?") and not present:
            raise KeyError(f"{name}: {arg}")
        return env[name] if present else (arg if op in ("-", ":-") else "")
    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def resolved(raw) -> dict:
    return interpolate(raw, read_env(ENV_EXAMPLE))


def latentsweep_commands(config: dict) -> dict[str, list[str]]:
    out = {}
    for name, service in config["services"].items():
        command = service.get("command")
        command = shlex.split(command) if isinstance(command, str) else command
        if command and command[0] == "latentsweep":
            out[name] = command
    return out


# ---- the compose file ------------------------------------------------------------------------------------------------

def _compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) when it answers, else the standalone `docker-compose`, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _compose_config(env_file: Path, *overrides: Path) -> subprocess.CompletedProcess:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose client (docker compose plugin or docker-compose) on this machine")
    # The settings must come from the env file alone, not from whoever runs the tests.
    env = {k: v for k, v in os.environ.items() if k not in read_env(ENV_EXAMPLE) and not k.startswith("COMPOSE_")}
    files = [arg for path in (COMPOSE, *overrides) for arg in ("-f", str(path))]
    return subprocess.run([*cli, "--env-file", str(env_file), *files, "config"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_compose_config_validates_with_env_example(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(ENV_EXAMPLE.read_text())
    proc = _compose_config(env_file)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert set(config["services"]) == {"postgres", "mlflow", "dashboard", "worker", "create-study"}
    for name, port in UI_PORTS.items():
        (published,) = config["services"][name]["ports"]
        if isinstance(published, dict):  # compose v2 prints the long form
            assert published["host_ip"] == "127.0.0.1" and int(published["target"]) == port
        else:
            assert published.startswith(f"127.0.0.1:{port}:{port}")
    assert latentsweep_commands(config) == latentsweep_commands(interpolate(yaml.safe_load(COMPOSE.read_text()),
                                                                            read_env(env_file)))


def test_compose_config_refuses_to_run_without_a_password(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("".join(line + "\n" for line in ENV_EXAMPLE.read_text().splitlines()
                                if not line.startswith("POSTGRES_PASSWORD=")))
    proc = _compose_config(env_file)
    assert proc.returncode != 0
    assert "POSTGRES_PASSWORD" in proc.stderr and "set POSTGRES_PASSWORD in .env" in proc.stderr


def test_services_and_dependencies(resolved):
    services = resolved["services"]
    assert set(services) == {"postgres", "mlflow", "dashboard", "worker", "create-study"}
    pg = services["postgres"]
    assert pg["image"] == "postgres:16"
    assert interpolate(yaml.safe_load(COMPOSE.read_text())["services"]["postgres"]["image"], {}) == "postgres:16"
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.split(":")[0] in resolved["volumes"] for v in pg["volumes"])  # a named volume
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["create-study"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["create-study"]["condition"] == "service_completed_successfully"
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # so `--scale worker=N` works


def test_every_latentsweep_command_parses(resolved):
    commands = latentsweep_commands(resolved)
    assert set(commands) == {"worker", "create-study"}
    parser = build_parser()
    handlers = {"worker": "cmd_worker", "create-study": "cmd_study_create"}
    for name, command in commands.items():
        args = parser.parse_args(command[1:])
        assert args.func.__name__ == handlers[name]
        assert args.storage.startswith("postgresql+psycopg2://")  # psycopg 3 is not installed
        assert args.tracking_uri == "http://mlflow:5000"
        assert 0 < args.heartbeat < args.grace
        # the default study file exists (./studies is mounted at /app/studies) and is valid
        assert load_study_file(ROOT / args.study).name


def test_mlflow_server_command(resolved):
    from mlflow.cli import server

    mlflow = resolved["services"]["mlflow"]
    script = mlflow["command"][-1]
    assert "CREATE DATABASE mlflow" in script  # its own database beside Optuna's
    exec_line = script.split("exec ", 1)[1].replace("\\\n", " ").replace("$${", "${")
    argv = shlex.split(exec_line)
    assert argv[:2] == ["mlflow", "server"]
    params = server.make_context("server", argv[2:]).params  # raises on an option mlflow does not have
    assert params["backend_store_uri"].startswith("postgresql+psycopg2://")
    assert params["serve_artifacts"] and params["default_artifact_root"] == "mlflow-artifacts:/"
    # MLflow >= 3.5 rejects unknown Host headers; patterns are fnmatch-style, as MLflow reads them
    assert any(fnmatch.fnmatch("mlflow:5000", host) for host in params["allowed_hosts"].split(","))
    assert "--port 5000" in exec_line
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


def test_dashboard_command(resolved):
    command = resolved["services"]["dashboard"]["command"]
    assert command[0] == "optuna-dashboard" and command[1].startswith("postgresql+psycopg2://")
    exe = Path(sys.executable).with_name("optuna-dashboard")
    helptext = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for option in (a for a in command[2:] if a.startswith("--")):
        assert option in helptext


def _strings(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _strings(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _strings(value)
    elif isinstance(tree, str):
        yield tree


def test_no_literal_password(raw, resolved):
    from urllib.parse import urlsplit

    placeholder = read_env(ENV_EXAMPLE)["POSTGRES_PASSWORD"]
    assert placeholder not in COMPOSE.read_text()
    # No URL carries a password, even once .env is applied (clients get it from PGPASSWORD): command lines show up
    # in `ps`, `docker inspect` and MLflow run parameters.
    urls = [u for s in _strings(resolved) for u in re.findall(r"[a-z0-9+]+://[^\s\"']+", s)]
    assert any(u.startswith("postgresql+psycopg2://") for u in urls)
    assert all(urlsplit(u).password is None for u in urls), urls
    for service in raw["services"].values():
        env = service.get("environment", {})
        for key, value in env.items():
            if "PASSWORD" in key:
                assert re.fullmatch(r"\$\{POSTGRES_PASSWORD:\?[^}]+\}", value), (key, value)


def test_uis_published_on_loopback_by_default(raw, resolved):
    published = {name: s["ports"] for name, s in raw["services"].items() if s.get("ports")}
    assert set(published) == set(UI_PORTS)  # PostgreSQL is reachable only inside the compose network
    for name, port in UI_PORTS.items():
        (spec,) = published[name]
        assert spec.startswith("${BIND_ADDRESS:-127.0.0.1}:")
        defaults = interpolate(raw, {"POSTGRES_PASSWORD": "x"})["services"][name]["ports"][0]
        assert defaults == f"127.0.0.1:{port}:{port}"
        assert resolved["services"][name]["ports"][0].startswith("127.0.0.1:")


def test_env_example_documents_every_variable(raw):
    used = {m["name"] for path in (COMPOSE, HOSTNET, OFFLINE) for m in _VAR.finditer(path.read_text()) if m["name"]}
    assert used <= set(read_env(ENV_EXAMPLE)), used - set(read_env(ENV_EXAMPLE))


# ---- the image -------------------------------------------------------------------------------------------------------

def test_dockerfile_base_image_and_torch_index_args():
    text = (ROOT / "Dockerfile").read_text()
    first_from = text.index("\nFROM ")
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text[:first_from], re.M)  # usable in FROM
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in text
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)


def test_dockerignore_keeps_state_and_secrets_out():
    entries = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {"mlruns/", ".venv/", ".git/", ".env"} <= entries


def test_dockerfile_keeps_build_settings_out_of_the_image():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)
    builder, final = next(st for st in stages if st.startswith("base AS builder")), stages[-1]
    assert "COPY deploy/build-env/ /build-env/" in builder and "PIP_CONFIG_FILE=/build-env/pip.conf" in builder
    assert re.search(r"rm -rf [^\n]*deploy/build-env", builder)  # the source copied on to the final stage
    assert "build-env" not in final and "COPY --from=builder /opt/venv /opt/venv" in final
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not {"deploy/", "deploy/build-env/", "deploy/build-env"} & ignored  # the builder stage needs it


def test_build_env_script_pins_local_wheels(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir(), out.mkdir()
    (wheels / "torch-9.9.9+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "ca.crt").write_text("CA")
    env = {**os.environ, "BUILD_ENV_DIR": str(out), "PIP_CERT": str(tmp_path / "ca.crt"),
           "PIP_FIND_LINKS": f"file://{wheels} {tmp_path / 'missing'}", "PIP": "false"}
    for _ in range(2):  # a second run changes nothing (the build cache stays valid)
        subprocess.run(["sh", str(ROOT / "deploy" / "build-env.sh")], env=env, check=True, capture_output=True)
        stamp = (out / "pip.conf").stat().st_mtime_ns
    conf = (out / "pip.conf").read_text()
    assert "cert = /build-env/ca-certificates.crt" in conf and "find-links = /build-env/wheels1\n" in conf
    assert "constraint = /build-env/constraints.txt" in conf
    assert (out / "constraints.txt").read_text() == "torch==9.9.9+cpu\n"
    assert (out / "ca-certificates.crt").read_text() == "CA"
    assert (out / "wheels1" / "torch-9.9.9+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").read_bytes() == b"wheel"
    assert (out / "pip.conf").stat().st_mtime_ns == stamp


def test_override_files(raw):
    hostnet, offline = yaml.safe_load(HOSTNET.read_text()), yaml.safe_load(OFFLINE.read_text())
    assert set(hostnet["services"]) == set(raw["services"])
    for name, service in hostnet["services"].items():
        assert service["network_mode"] == "host"
        assert set(service["extra_hosts"]) == {"postgres:127.0.0.1", "mlflow:127.0.0.1"}
        if "build" in raw["services"][name]:
            assert service["build"]["network"] == "host"
    # with the host's network, the servers listen on loopback only (published ports no longer apply)
    assert "listen_addresses=127.0.0.1" in hostnet["services"]["postgres"]["command"]
    assert hostnet["services"]["mlflow"]["environment"]["MLFLOW_HOST"] == "127.0.0.1"
    assert '--host "$${MLFLOW_HOST:-0.0.0.0}"' in raw["services"]["mlflow"]["command"][-1]
    dashboard = hostnet["services"]["dashboard"]["command"]
    assert dashboard[dashboard.index("--host") + 1] == "127.0.0.1"
    assert dashboard[:2] == raw["services"]["dashboard"]["command"][:2]
    pg = offline["services"]["postgres"]
    assert set(offline["services"]) == {"postgres"} and pg["image"] != raw["services"]["postgres"]["image"]
    assert (ROOT / pg["build"]["context"] / "Dockerfile").exists()


def test_compose_config_with_overrides(tmp_path, raw):
    env_file = tmp_path / ".env"
    env_file.write_text(ENV_EXAMPLE.read_text())
    proc = _compose_config(env_file, HOSTNET, OFFLINE)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert {s.get("network_mode") for s in config["services"].values()} == {"host"}
    assert config["services"]["postgres"]["image"] == "latentsweep-postgres:bookworm"
    assert config["services"]["postgres"]["build"]["context"].endswith("deploy/postgres")
    # the commands that run latentsweep are the main file's
    assert latentsweep_commands(config) == latentsweep_commands(interpolate(raw, read_env(env_file)))


def test_deploy_scripts_parse_and_smoke_study_is_tiny():
    for script in ("deploy/base-image.sh", "deploy/build-env.sh", "deploy/postgres/entrypoint.sh"):
        subprocess.run(["sh", "-n", str(ROOT / script)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "deploy" / "smoke.sh")], check=True)
    compile((ROOT / "deploy" / "smoke_check.py").read_text(), "smoke_check.py", "exec")
    smoke = ROOT / "deploy" / "smoke" / "smoke.toml"
    sf = load_study_file(smoke)
    assert sf.name == "smoke" and sf.n_trials == tomllib.loads(smoke.read_text())["study"]["n_trials"] <= 10
    # smoke.sh reads n_trials with sed: the line it expects
    assert re.search(rf"^n_trials = {sf.n_trials}$", smoke.read_text(), re.M)


def test_drop_ports_removes_only_ports():
    rendered = """services:
  mlflow:
    command:
    - mlflow
    ports:
    - 127.0.0.1:5000:5000/tcp
    - 127.0.0.1:5001:5001/tcp
    restart: unless-stopped
  dashboard:
    ports:
      - mode: ingress
        host_ip: 127.0.0.1
        target: 8080
        published: "8080"
    image: latentsweep:local
volumes:
  worker-state: {}
"""
    out = subprocess.run(["sh", str(ROOT / "deploy" / "drop-ports.sh")], input=rendered, capture_output=True,
                         text=True, check=True).stdout
    assert yaml.safe_load(out) == {"services": {"mlflow": {"command": ["mlflow"], "restart": "unless-stopped"},
                                                "dashboard": {"image": "latentsweep:local"}},
                                   "volumes": {"worker-state": {}}}


def test_gpu_workers_get_their_slot_by_the_study_run_rule(raw, monkeypatch):
    """WORKER_GPUS/WORKER_PER_GPU reach each worker replica as the defaults of its --gpus/--per-gpu (empty: none, so a
    CPU deployment is unchanged)."""
    for env, gpus, per_gpu in (({}, None, None), ({"WORKER_GPUS": "all", "WORKER_PER_GPU": "2"}, "all", 2)):
        worker = interpolate(raw, {**read_env(ENV_EXAMPLE), **env})["services"]["worker"]
        for key, value in worker["environment"].items():
            monkeypatch.setenv(key, str(value))
        args = build_parser().parse_args(worker["command"][1:])
        assert env_defaults(args.gpus, args.per_gpu)[:2] == (gpus, per_gpu)
