"""Hostile-input corpus, part 5 (issue 34): outputs that would replace inputs, inputs checked only after the work,
values never bounded (infinite durations, a billion seeds, more folds than images, negative seeds), plugins that
exit or half-register, side entries and recipes the study file took, `study init` names, and the Python API's
argument types. Same contract as parts 2-3 (bad_input_kit.assert_rejected): exit 2, one line, nothing written."""
from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from bad_input_kit import GOOD_STUDY, NAME, assert_rejected, problem_lines
from latentsweep.search import api
from latentsweep.search.cli.main import main
from latentsweep.search.study.presets import presets_dir
from latentsweep.search.study.side import SIDE_ATTR
from latentsweep.trainers.core.errors import LatentsweepError

ROOT = Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- data holdout: an output never replaces an input ----------------------------------------------------------------

def test_holdout_into_its_input_directory_keeps_the_input(data, existing, tmp_path, capsys):
    src = tmp_path / "train.npz"
    src.write_bytes(data["train"].read_bytes())
    before = _digest(src)
    code = main(["data", "holdout", str(src), "--out", str(tmp_path)])
    assert_rejected(capsys, code, existing, f"{src} is the input PATH", "would replace the input",
                    absent=[tmp_path / "test.clean.npz", tmp_path / "answers.npz"])
    assert _digest(src) == before
    code = main(["data", "holdout", str(src), "--out", str(tmp_path), "--force"])  # --force never covers the input
    assert_rejected(capsys, code, existing, "would replace the input")
    assert _digest(src) == before


def test_holdout_does_not_replace_earlier_holdout_files_without_force(data, existing, tmp_path, capsys):
    out = tmp_path / "h"
    assert main(["data", "holdout", str(data["train"]), "--out", str(out)]) == 0
    capsys.readouterr()
    answers = _digest(out / "answers.npz")
    code = main(["data", "holdout", str(data["train"]), "--out", str(out), "--seed", "5"])
    assert_rejected(capsys, code, existing, f"{out / 'answers.npz'}", "already exist", "--force")
    assert _digest(out / "answers.npz") == answers
    assert main(["data", "holdout", str(data["train"]), "--out", str(out), "--seed", "5", "--force"]) == 0
    assert _digest(out / "answers.npz") != answers


def test_holdout_negative_seed_is_one_line(data, existing, tmp_path, capsys):
    code = main(["data", "holdout", str(data["train"]), "--out", str(tmp_path / "h"), "--seed", "-1"])
    assert_rejected(capsys, code, existing, "--seed must be >= 0, got -1", absent=[tmp_path / "h"])


# ---- pick: every option checked before any work ---------------------------------------------------------------------

def _pick(existing, tmp_path, *extra) -> list[str]:
    return ["pick", NAME, "--state-dir", str(existing["state"]), "--out", str(tmp_path / "pick" / "sub.csv"),
            "--quiet", *extra]


PICK_CASES = {  # extra arguments, fragments of the one-line error
    "register_slash": (["--register", "my/model"], ["--register 'my/model'", "cannot contain '/' or ':'"]),
    "register_colon": (["--register", "a:b"], ["--register 'a:b'", "cannot contain '/' or ':'"]),
    "register_blank": (["--register", " "], ["--register ' '", "cannot be blank"]),
    "seeds_billion": (["--seeds", "1000000000", "--budget", "60"], ["--seeds must be <= 100", "1000000000"]),
    "seed_negative": (["--seed", "-1"], ["--seed must be >= 0, got -1"]),
    "budget_infinite": (["--budget", "9" * 400], ["--budget must be a positive number of seconds", "inf"]),
}


@pytest.mark.parametrize("case", sorted(PICK_CASES))
def test_pick_options_are_refused_before_any_work(case, existing, tmp_path, capsys):
    extra, fragments = PICK_CASES[case]
    assert_rejected(capsys, main(_pick(existing, tmp_path, *extra)), existing, *fragments,
                    absent=[tmp_path / "pick"])


@pytest.fixture(scope="module")
def two_trials(tmp_path_factory, data) -> Path:
    """A finished two-trial study (out-of-fold selection needs two candidates) on the corpus's 40-image data."""
    root = tmp_path_factory.mktemp("two_trials")
    study = root / "two.toml"
    study.write_text(GOOD_STUDY.replace(f'name = "{NAME}"', 'name = "two"').replace("n_trials = 1", "n_trials = 2"))
    assert main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(root / "state"),
                 "--quiet"]) == 0
    return root / "state"


def test_pick_more_folds_than_images_is_refused_before_any_fold_job(two_trials, tmp_path, capsys):
    capsys.readouterr()
    code = main(["pick", "two", "--state-dir", str(two_trials), "--out", str(tmp_path / "p" / "sub.csv"), "--quiet",
                 "--selection", "oof", "--folds", "100000", "--budget", "60"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and out == ""
    assert err.strip().splitlines()[-1] == ("latentsweep: error: --folds must be <= 40 (the data has 40 images), "
                                            "got 100000")
    assert not (tmp_path / "p").exists() and not (two_trials / "picks" / "two" / "runs").exists()


def test_pick_leaves_no_folder_in_the_temp_dir(two_trials, tmp_path, monkeypatch, capsys):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    assert main(["pick", "two", "--state-dir", str(two_trials), "--out", str(tmp_path / "p" / "sub.csv"), "--quiet",
                 "--budget", "60", "--seeds", "1"]) == 0
    assert not list(temp.glob("latentsweep-*"))


# ---- a train file is not a test file ---------------------------------------------------------------------------------

def test_a_train_file_given_as_test_is_refused(data, existing, tmp_path, capsys):
    code = main(_pick(existing, tmp_path, "--test", str(data["train"])))
    assert_rejected(capsys, code, existing, f"{data['train']}: a train file", "not a test file",
                    absent=[tmp_path / "pick"])
    sub = tmp_path / "sub.csv"
    sub.write_text("id,embedding\n")
    code = main(["submission", "check", str(sub), "--test", str(data["train"])])
    assert_rejected(capsys, code, existing, "a train file", "not a test file")


# ---- plugins ---------------------------------------------------------------------------------------------------------

def _plugin_study(tmp_path: Path, body: str) -> Path:
    (tmp_path / "mine.py").write_text(textwrap.dedent(body))
    study = tmp_path / "plug.toml"
    study.write_text(GOOD_STUDY.replace('n_trials = 1', 'n_trials = 1\nplugins = ["mine.py"]'))
    return study


PLUGIN_EXITS = {  # plugin body, fragment
    "exit_none": ("import sys\nsys.exit()\n", "mine.py:2: the plugin called sys.exit(None)"),
    "exit_3": ("import sys\nsys.exit(3)\n", "mine.py:2: the plugin called sys.exit(3)"),
    "interrupt": ("raise KeyboardInterrupt\n", "mine.py:1: KeyboardInterrupt while the plugin was imported"),
}


@pytest.mark.parametrize("body,fragment", list(PLUGIN_EXITS.values()), ids=list(PLUGIN_EXITS))
def test_a_plugin_that_exits_at_import_is_one_line_naming_it(body, fragment, data, existing, tmp_path, capsys):
    study = _plugin_study(tmp_path, body)
    code = main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    assert_rejected(capsys, code, existing, fragment, "(a plugin of")


def test_a_knob_whose_low_is_above_its_high_is_refused(data, existing, tmp_path, capsys):
    study = _plugin_study(tmp_path, """\
        from dataclasses import dataclass
        from latentsweep.trainers.config.knobs import knob
        from latentsweep.trainers.losses.base import Loss, register_loss

        @dataclass(frozen=True)
        class EmptyRangeCfg:
            weight: float = knob(0.0, low=0.0)
            scale: float = knob(10.0, low=50.0, high=1.0)

        @register_loss("empty_range", config=EmptyRangeCfg)
        class EmptyRange(Loss):
            pass
        """)
    code = main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    assert_rejected(capsys, code, existing, "mine.py:8: ValueError", "low is above high")


FIXABLE = """
import torch
from dataclasses import dataclass
from latentsweep.trainers.config.knobs import knob
from latentsweep.trainers.losses.base import Loss, register_loss
from latentsweep.trainers.models.zoo import register_model

@dataclass(frozen=True)
class Round5Cfg:
    weight: float = knob(0.0, low=0.0)

@register_loss("round5", config=Round5Cfg)
class Round5(Loss):
    pass

@register_model("round5_model")
def build(cfg, ctx):
    return torch.nn.Identity()
"""

RELOAD = f"""
import sys
from pathlib import Path
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses.base import LOSSES
from latentsweep.trainers.models.zoo import MODELS
plugin, study = Path(sys.argv[1]), Path(sys.argv[2])
plugin.write_text({FIXABLE!r} + "raise RuntimeError('oops, a typo below the registrations')\\n")
try:
    load_study_file(study)
except ConfigError as exc:
    print("first:", exc)
assert "round5" not in LOSSES and "round5_model" not in MODELS, "registrations of the failed import remain"
plugin.write_text({FIXABLE!r})
load_study_file(study)
print("second: loaded", "round5" in LOSSES, "round5_model" in MODELS)
"""


def test_a_plugin_fixed_after_a_failed_import_loads_in_the_same_process(tmp_path):
    """The failed import's registrations (a loss with its config section, a model) are rolled back (in a
    subprocess: a successful load registers for good)."""
    study = _plugin_study(tmp_path, "")
    run = subprocess.run([sys.executable, "-c", RELOAD, str(tmp_path / "mine.py"), str(study)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.strip().splitlines()
    assert "mine.py:19: RuntimeError: oops" in first
    assert second == "second: loaded True True"


# ---- study files: [[side]] and [[enqueue]] ---------------------------------------------------------------------------

SIDE_OWNED = {  # the side entry, the problem's fragment
    "val_ratio": ("data = { val_ratio = 0.5 }", "data.val_ratio belongs to the study"),
    "split": ('data = { split = "kfold" }', "data.split belongs to the study"),
    "path": ('data = { path = "other.npz" }', "data.path belongs to the study"),
    "plugins": ('plugins = { files = ["x.py"] }', "plugins.files belongs to the study"),
}


@pytest.mark.parametrize("case", sorted(SIDE_OWNED))
def test_side_entries_cannot_set_what_belongs_to_the_study(case, data, existing, tmp_path, capsys):
    entry, fragment = SIDE_OWNED[case]
    study = tmp_path / "side.toml"
    study.write_text(GOOD_STUDY + f'\n[[side]]\nmodel = {{ kind = "knn" }}\n{entry}\n')
    code = main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    (problem,) = problem_lines(capsys, code, study)
    assert f"side[0]: {fragment}" in problem


def test_side_entry_device_is_checked_on_this_machine(data, existing, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    study = tmp_path / "side.toml"
    study.write_text(GOOD_STUDY + '\n[[side]]\ntrain = { device = "cuda" }\n')
    code = main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    assert_rejected(capsys, code, existing, "side[0]: train.device", "cuda")


def test_identical_side_entries_run_once(data, tmp_path, capsys):
    study = tmp_path / "twice.toml"
    side = '\n[[side]]\nmodel = { kind = "knn" }\n'
    study.write_text(GOOD_STUDY.replace(f'"{NAME}"', '"twice"').replace("n_trials = 1", "n_trials = 2")
                     + side + side)
    state = tmp_path / "state"
    assert main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(state), "--quiet"]) == 0
    trials = optuna.load_study(study_name="twice", storage=f"sqlite:///{state / 'optuna.db'}").get_trials()
    assert len(trials) == 2 and sum(SIDE_ATTR in t.user_attrs for t in trials) == 1


@pytest.mark.parametrize("recipe", ["5", '["moco.toml"]', '{ file = "x.toml" }', '""'])
def test_an_enqueue_recipe_that_is_not_a_file_name_is_one_problem(recipe, data, existing, tmp_path, capsys):
    study = tmp_path / "recipe.toml"
    study.write_text(GOOD_STUDY + f"\n[[enqueue]]\nrecipe = {recipe}\n")
    code = main(["study", "run", str(study), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    (problem,) = problem_lines(capsys, code, study)
    assert "enqueue[0]: recipe must be the file name of a study file" in problem


# ---- study init ------------------------------------------------------------------------------------------------------

def test_study_init_refuses_a_name_that_is_one_of_the_presets_recipes(existing, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert_rejected(capsys, main(["study", "init", "union", "moco.toml"]), existing, "moco.toml",
                    "union enqueues the recipe moco.toml", absent=[tmp_path / "moco.toml"])


def test_study_init_works_beside_a_file_named_like_the_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full.toml").write_text("my own edits\n")
    assert main(["study", "init", "full.toml", "copy.toml"]) == 0  # the preset, not the file here
    copy = (tmp_path / "copy.toml").read_text()  # the preset, its own recipe renamed to the copy
    assert copy.replace('"copy.toml"', '"full.toml"') == (presets_dir() / "full.toml").read_text()
    assert (tmp_path / "full.toml").read_text() == "my own edits\n"


# ---- study create closes its parent run ------------------------------------------------------------------------------

def test_study_create_leaves_no_mlflow_run_running(data, tmp_path, capsys):
    state = tmp_path / "state"
    study = tmp_path / "created.toml"
    study.write_text(GOOD_STUDY.replace(f'"{NAME}"', '"created"'))
    assert main(["study", "create", str(study), "--data", str(data["train"]), "--state-dir", str(state)]) == 0
    with sqlite3.connect(state / "mlflow.db") as conn:
        runs = conn.execute("SELECT name, status FROM runs").fetchall()
    assert runs and all(status != "RUNNING" for _, status in runs), runs


# ---- --time / timeout: finite and bounded ----------------------------------------------------------------------------

def test_run_time_of_400_nines_is_refused(existing, tmp_path, capsys):
    code = main(["run", str(tmp_path / "missing.toml"), "--time", "9" * 400, "--state-dir", str(existing["state"])])
    assert_rejected(capsys, code, existing, "--time 9999", "is over 7 days")


def test_study_timeout_beyond_any_plan_is_refused(data, existing, capsys):
    code = main(["study", "run", str(existing["study_file"]), "--data", str(data["train"]), "--state-dir",
                 str(existing["state"]), "--timeout", "1e12"])  # 31,000 years: a typo, not a plan
    assert_rejected(capsys, code, existing, "--timeout must be a positive number of seconds up to")


# ---- the Python API: arguments named with the type expected ----------------------------------------------------------

API_CASES = {  # call, fragments of the LatentsweepError
    "workers_text": (lambda e, d: api.run_study(e["study_file"], data=str(d["train"]), workers="2",
                                                 state_dir=str(e["state"])), ["workers must be a whole number",
                                                                              "str '2'"]),
    "workers_bool": (lambda e, d: api.run_study(e["study_file"], workers=True, state_dir=str(e["state"])),
                     ["workers must be a whole number", "bool True"]),
    "n_trials_text": (lambda e, d: api.run_study(e["study_file"], n_trials="3", state_dir=str(e["state"])),
                      ["n_trials must be a whole number"]),
    "timeout_infinite": (lambda e, d: api.run_study(e["study_file"], timeout=float("inf"),
                                                     state_dir=str(e["state"])), ["timeout must be a positive"]),
    "trials_none": (lambda e, d: api.trials(None, state_dir=str(e["state"])), ["study must be a string",
                                                                               "NoneType None"]),
    "pick_budget_bool": (lambda e, d: api.pick_ensemble(NAME, state_dir=str(e["state"]), budget=True),
                         ["--budget must be a number", "bool True"]),
    "pick_top_text": (lambda e, d: api.pick_ensemble(NAME, state_dir=str(e["state"]), top="5"),
                      ["--top must be a whole number"]),
    "pick_refit_text": (lambda e, d: api.pick_ensemble(NAME, state_dir=str(e["state"]), refit="no"),
                        ["refit must be true or false"]),
    "run_time_infinite": (lambda e, d: api.run(e["study_file"], "9" * 400, state_dir=str(e["state"])),
                          ["--time 9999", "is over 7 days"]),
    "run_register": (lambda e, d: api.run(e["study_file"], "30m", register="a/b", state_dir=str(e["state"])),
                     ["register 'a/b'", "cannot contain '/' or ':'"]),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_api_arguments_of_the_wrong_type_name_the_argument(case, data, existing):
    call, fragments = API_CASES[case]
    with pytest.raises(LatentsweepError) as info:
        call(existing, data)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and all(f in message for f in fragments), message

