"""One progress channel (trainers/core/progress.py's `say`, pointed by search/progress.py): the CLI says its lines on
stderr, the Python API says nothing with progress=False and hands every line to a sink of the caller's with
set_progress_sink; library code never prints or logs, so a notebook that configured logging sees each line once."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import latentsweep
from conftest import tiny_study_file
from latentsweep.trainers.core.progress import progress_to, say, set_progress_sink

ROOT = Path(__file__).resolve().parents[1]


# The suite's tiny study with a queue (4096) larger than the data's distinct images: the trainer says the cap once per
# sink, a line that went through a logger (and so to a notebook's root handler as well) before there was one door.
QUEUE = """"loss.queue_infonce.weight" = { type = "categorical", choices = [1.0] }
"loss.queue_infonce.size" = { type = "categorical", choices = [4096] }"""
# A notebook: the root logger configured first (INFO, stderr), then a study with progress, and a study and its pick
# without.
NOTEBOOK = """
import logging, sys
logging.basicConfig(level=logging.INFO)
import latentsweep
train, test, state, loud, quiet = sys.argv[1:]
latentsweep.run_study(loud, data=train, state_dir=state)
print("--- progress off ---", file=sys.stderr, flush=True)
latentsweep.run_study(quiet, data=train, state_dir=state, progress=False)
latentsweep.pick_ensemble("quiet", state_dir=state, progress=False, top=2, refit=False, data=train, test=test,
                     out=state + "/submission.csv")
"""
# A record of one of our loggers under logging.basicConfig's format, LEVEL:NAME:message (after a bar's \r, too)
OUR_RECORD = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL):(latentsweep|search|trainers)[.:]")


@pytest.mark.slow  # 20 to 50 s on 2 busy cores (MLflow's first tables, 4 trials, a pick): .ci/run's slow step
def test_a_notebook_with_logging_configured_sees_each_line_once_and_nothing_with_progress_off(data, tmp_path):
    for name in ("loud", "quiet"):
        tiny_study_file(tmp_path, name, n_trials=2, epochs=1, extra=QUEUE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LATENTSWEEP_PROGRESS", None)
    args = [data["train"], data["test"], tmp_path / "state", tmp_path / "loud.toml", tmp_path / "quiet.toml"]
    done = subprocess.run([sys.executable, "-c", NOTEBOOK, *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loud, quiet = done.stderr.split("--- progress off ---\n")
    trials = re.findall(r"study loud trial \d+ [A-Z]+", loud)  # a line may follow a bar's \r on its row
    assert len(trials) == 2, loud
    for said in (*trials, "loss.queue_infonce.size 4096 is more than the"):
        assert loud.count(said) == 1, (said, loud)  # once: not again through the root logger
    assert not OUR_RECORD.search(loud), loud
    assert done.stdout == ""
    assert quiet == "", quiet  # progress off: nothing, though the root logger would print any record it got
    assert (tmp_path / "state" / "submission.csv").is_file()


def test_a_sink_receives_the_lines_and_none_silences_them(capfd):
    lines: list[str] = []
    with progress_to(lines.append):
        say("one")
        say("capped", once="k")
        say("capped", once="k")  # said once per sink: a study's trials share one message
    with progress_to(None):
        say("nothing")
        say("capped again", once="k2")
    assert lines == ["one", "capped"]
    assert capfd.readouterr() == ("", "")


def test_the_default_sink_is_stderr_and_the_api_exports_the_switch(capfd):
    assert latentsweep.set_progress_sink is set_progress_sink
    say("latentsweep: hello")
    assert capfd.readouterr() == ("", "latentsweep: hello\n")


@pytest.fixture(autouse=True)
def _restore_sink():
    previous = set_progress_sink(None)
    set_progress_sink(previous)  # read the current sink, and keep it
    yield
    set_progress_sink(previous)


def test_a_silent_call_starts_its_child_processes_silent():
    """progress=False reaches the workers a study spawns through the environment they inherit (a child that imports
    search gets the stderr sink unless that environment says off)."""
    from latentsweep.search.progress import PROGRESS_ENV, quiet_libraries

    code = "import latentsweep; from latentsweep.trainers.core.progress import say; say('a line a spawned worker would say')"
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    with quiet_libraries():
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loud.stderr == "a line a spawned worker would say\n"
    assert child.stderr == "" and PROGRESS_ENV not in os.environ


def test_the_cli_and_a_spawned_worker_say_an_error_in_one_line_from_one_place(capfd):
    from latentsweep.search.progress import report_error
    from latentsweep.search.failures import StudyHalted
    from latentsweep.trainers.core.errors import ConfigError

    with progress_to(None):  # an error is not progress: said with progress off too
        assert report_error(ConfigError("bad knob")) == 2
        assert report_error(StudyHalted("another worker stopped on a bug")) == 1
        assert report_error(TypeError("our bug")) is None  # raised by the caller, traceback and all
    assert capfd.readouterr() == ("", "latentsweep: error: bad knob\n"
                                      "latentsweep: error: another worker stopped on a bug\n")


# Where our code may write to stdout or stderr itself: a command's own output (search/cli/), the stderr sink and the one
# error line (search/progress.py), and the channel's word about a failing sink (trainers/core/progress.py).
MAY_PRINT = ("search/cli/", "search/progress.py", "trainers/core/progress.py")
LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
OURS = ("latentsweep", "search", "trainers")


def test_no_module_prints_or_logs_beside_the_channel():
    """Every other line goes through `say`: no print or stream write outside MAY_PRINT, no logger of our own (a
    record would reach a notebook's root logger as well as the sink), no logging.warning (the root logger itself)."""
    found = []
    for path in sorted([*ROOT.glob("search/**/*.py"), *ROOT.glob("trainers/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
            if (name == "print" or owner in ("sys.stderr", "sys.stdout", "tqdm")
                    and name == "write") and not rel.startswith(MAY_PRINT):
                found.append(f"{rel}:{node.lineno} {ast.unparse(f)}")
            if name == "getLogger":  # the root logger, or one of ours (libraries' loggers are set by name variables)
                arg = node.args[0] if node.args else None
                if arg is None or ast.unparse(arg) == "__name__" or (
                        isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in OURS):
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            if owner == "logging" and name in LOG_CALLS:
                found.append(f"{rel}:{node.lineno} {ast.unparse(f)}")
    assert not found, found
