"""One progress channel (search/progress.py): the CLI says its lines on stderr, the Python API says nothing with
progress=False and hands every line to a sink of the caller's with set_progress_sink; library code never prints."""
from __future__ import annotations

import logging

import pytest

import search
from search import api
from search.progress import progress_to, say, set_progress_sink
from trainers.progress import tell

TINY = """
[study]
name = "quiet"
n_trials = 2
sampler = { name = "random", seed = 0 }
pruner = { name = "none" }

[base.data]
split = "hash"
val_ratio = 0.2

[base.model]
kind = "mlp"
hidden = [32]

[base.loss]
infonce = { weight = 1.0 }

[base.train]
epochs = 1
batch_size = 256

[space]
"optim.lr" = { type = "float", low = 2e-4, high = 3e-3, log = true }
"""


def test_the_api_with_progress_off_says_nothing_on_stdout_or_stderr(tmp_path, capfd):
    study = tmp_path / "quiet.toml"
    study.write_text(TINY)
    state = str(tmp_path / "state")
    summary = api.run_study(study, state_dir=state, progress=False)
    picked = api.pick_ensemble("quiet", state_dir=state, progress=False, top=1, seeds=1, budget="none")
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
