"""Plugins: a user's loss or model in one file, named by a study file. Broken plugins fail in one line naming the file
and line before trial 0; the two examples are searched, picked and served without latentsweep (in subprocesses, so
that their registrations stay out of this test process)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

STUDY = """
[study]
name = "{name}"
plugins = {plugins}
n_trials = {n_trials}
sampler = {{ name = "tpe", seed = 0, n_startup_trials = 2 }}
pruner = {{ name = "none" }}

[base.data]
val_ratio = 0.25

[base.model]
kind = "{kind}"
hidden = [32]

[base.loss]
{loss} = {{ weight = 1.0 }}

[base.train]
epochs = 2
batch_size = 64

[space]
{space}
"""


def study_file(tmp: Path, name: str, plugins: list[str], kind="mlp", loss="infonce", space="", n_trials=1) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(STUDY.format(name=name, plugins=json.dumps(plugins), kind=kind, loss=loss, space=space,
                                 n_trials=n_trials))
    return path


def broken(tmp: Path, body: str) -> Path:
    (tmp / "mine.py").write_text(textwrap.dedent(body))
    return study_file(tmp, "broken", ["mine.py"])


def one_line_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_study_file(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_an_import_error_names_the_plugin_file_and_line(tmp_path):
    message = one_line_error(broken(tmp_path, """\
        import torch
        import no_such_module_here
        """))
    assert f"{tmp_path / 'mine.py'}:2: ModuleNotFoundError" in message and "no_such_module_here" in message


def test_a_syntax_error_names_the_plugin_file_and_line(tmp_path):
    message = one_line_error(broken(tmp_path, "x = 1\ndef f(:\n"))
    assert f"{tmp_path / 'mine.py'}:2: SyntaxError" in message


def test_a_knob_clashing_with_a_built_in_is_refused_at_its_line(tmp_path):
    message = one_line_error(broken(tmp_path, """\
        from dataclasses import dataclass
        from latentsweep.trainers.config.knobs import knob
        from latentsweep.trainers.models.zoo import register_model

        @dataclass(frozen=True)
        class HiddenCfg:
            width: int = knob(8)

        @register_model("hidden", config=HiddenCfg)
        def build(cfg, ctx):
            raise AssertionError
        """))
    assert "mine.py:9: ValueError" in message and "clashes with a built-in" in message


def test_a_loss_named_like_a_built_in_one_is_refused(tmp_path):
    message = one_line_error(broken(tmp_path, """\
        from latentsweep.trainers.losses.base import Loss, register_loss

        @register_loss("infonce")
        class Mine(Loss):
            pass
        """))
    assert "mine.py:3: ValueError" in message and "already registered" in message


def test_a_config_section_without_defaults_is_refused(tmp_path):
    message = one_line_error(broken(tmp_path, """\
        from dataclasses import dataclass
        from latentsweep.trainers.losses.base import Loss, register_loss

        @dataclass(frozen=True)
        class MineCfg:
            weight: float
            scale: float = 1.0

        @register_loss("mine_no_defaults", config=MineCfg)
        class Mine(Loss):
            pass
        """))
    assert "mine.py:9: ValueError" in message and "needs a default" in message and "weight" in message


def test_a_missing_plugin_file_is_one_line(tmp_path):
    message = one_line_error(study_file(tmp_path, "missing", ["nowhere.py"]))
    assert "nowhere.py: plugin file not found" in message


def run(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# Loads the pyfunc model with latentsweep's packages and the plugin files made unimportable.
SERVE = """
import sys, numpy as np
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "latentsweep" or name.startswith("latentsweep_plugin"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import mlflow.pyfunc
from mlflow import MlflowClient
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model(sys.argv[2])
test = np.load(sys.argv[3])
pred = model.predict(test["captions/embeddings"])
print(pred.shape, float(np.abs(np.linalg.norm(pred, axis=1) - 1).max()))
assert not any(m.split(".")[0] == "latentsweep" for m in sys.modules)
"""


@pytest.mark.slow
def test_both_examples_are_searched_refit_picked_and_served_without_latentsweep(tmp_path):
    train, test, _ = write_synthetic(tmp_path / "data", 240, dim_text=24, dim_image=32, n_test=40)
    for name in ("siglip_loss.py", "gated_model.py"):
        (tmp_path / name).write_bytes((EXAMPLES / name).read_bytes())
    space = '"loss.siglip.scale" = { type = "float", low = 3.0, high = 30.0, log = true }\n' \
            '"model.gated.gate_bias" = { type = "float", low = -4.0, high = 0.0 }\n' \
            '"model.gated.width" = { type = "categorical", choices = [16, 32] }'
    path = study_file(tmp_path, "plugged", ["siglip_loss.py", "gated_model.py"], kind="gated", loss="siglip",
                      space=space, n_trials=3)
    state = tmp_path / "state"
    run(["-m", "latentsweep", "study", "run", str(path), "--data", str(train), "--state-dir", str(state), "--quiet"],
        tmp_path)
    run(["-m", "latentsweep", "pick", "plugged", "--state-dir", str(state), "--top", "2", "--folds", "2",
                "--seeds", "1", "--budget", "none", "--test", str(test), "--quiet"], tmp_path)
    manifest = json.loads((state / "picks" / "plugged" / "submission.manifest.json").read_text())
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("plugged").experiment_id])
    trial_params = [r.data.params for r in runs if re.fullmatch(r"trial-\d+", r.info.run_name)]
    assert len(trial_params) == 3  # the plugin knobs are tracked like built-in ones, searched ones as search.*
    assert all({"loss.siglip.scale", "search.loss.siglip.scale", "model.gated.width", "plugins.files"} <= set(p)
               for p in trial_params)
    configs = list((state / "picks" / "plugged").rglob("config.toml"))
    assert configs, "pick ran no fold or refit job"
    for config in configs:  # every fold/refit job replayed the plugin knobs with the plugin's path and sha256
        text = config.read_text()
        assert "[loss.siglip]" in text and "[model.gated]" in text and "gated_model.py#sha256=" in text
    served = run(["-c", SERVE, f"sqlite:///{state / 'mlflow.db'}", manifest["mlflow"]["model_uri"], str(test)],
                 tmp_path)
    assert served.stdout.startswith("(40, 32)")

    # the same study, its plugin edited: a worker refuses it before any trial
    (tmp_path / "gated_model.py").write_text((tmp_path / "gated_model.py").read_text() + "\n# edited\n")
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "worker", str(path), "--data", str(train),
                           "--state-dir", str(state), "--n-trials", "4"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "gated_model.py differ from the ones the study was created with" in proc.stderr


def test_a_misspelt_plugin_knob_names_the_closest_one(tmp_path):
    (tmp_path / "siglip_loss.py").write_bytes((EXAMPLES / "siglip_loss.py").read_bytes())
    space = '"loss.siglip.scal" = { type = "float", low = 3.0, high = 30.0 }'
    path = study_file(tmp_path, "typo", ["siglip_loss.py"], loss="siglip", space=space)
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "study", "create", str(path), "--state-dir",
                           str(tmp_path / "state")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "loss.siglip.scal" in proc.stderr and "did you mean 'loss.siglip.scale'" in proc.stderr
