"""One progress channel (search/progress.py): the CLI says its lines on stderr, the Python API says nothing with
progress=False and hands every line to a sink of the caller's with set_progress_sink; library code never prints."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import search
from search import api
from search.progress import progress_to, say, set_progress_sink
from test_picker import STUDY, TINY_STUDY  # the picker tests' tiny study: 2 epochs of a 64-wide MLP
from trainers.progress import tell


@pytest.mark.slow  # 11 s: the suite's 10 minutes on 2 cores; .ci/run's slow step runs it
def test_the_api_with_progress_off_says_nothing_on_stdout_or_stderr(tmp_path, capfd):
    study = tmp_path / "tiny.toml"
    study.write_text(TINY_STUDY)
    state = str(tmp_path / "state")
    summary = api.run_study(study, n_trials=2, state_dir=state, progress=False)
    picked = api.pick_ensemble(STUDY, state_dir=state, progress=False, top=2, refit=False)
    assert summary and picked.submission.is_file()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_a_sink_receives_the_lines_and_none_silences_them(capfd):
    lines: list[str] = []
    with progress_to(lines.append):
        say("one")
        logging.getLogger("latentsweep").warning("a warning")  # the logger's warnings are progress lines too
        tell("capped", once="k")
        tell("capped", once="k")  # said once per sink: a study's trials share one message
    with progress_to(None):
        say("nothing")
        tell("capped again", once="k2")
    assert lines == ["one", "a warning", "capped"]
    assert capfd.readouterr() == ("", "")


def test_the_default_sink_is_stderr_and_the_api_exports_the_switch(capfd):
    assert search.set_progress_sink is set_progress_sink
    say("latentsweep: hello")
    assert capfd.readouterr() == ("", "latentsweep: hello\n")


@pytest.fixture(autouse=True)
def _restore_sink():
    previous = set_progress_sink(None)
    set_progress_sink(previous)  # read the current sink, and keep it
    yield
    set_progress_sink(previous)


def test_a_silent_call_starts_its_child_processes_silent():
    """progress=False reaches the workers a study spawns through the environment they inherit."""
    from search.progress import PROGRESS_ENV, quiet_libraries

    code = "from search.progress import say; say('a line a spawned worker would say')"
    with quiet_libraries():
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stderr == "" and PROGRESS_ENV not in os.environ
