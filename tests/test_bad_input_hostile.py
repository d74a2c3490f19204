"""Hostile-input corpus, part 2: one table of adversarial command lines (arguments, study files, data files,
checkpoints, submissions, paths, stores), each held to the same contract by bad_input_kit.assert_rejected: exit
code 2, one error line (study-file checks: one line per problem), no traceback, no partial output, no change to
the existing study or its runs. All in-process (latentsweep.search.cli.main.main), so the corpus stays fast."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from bad_input_kit import GOOD_STUDY, NAME, assert_rejected, problem_lines, snapshot
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.splits import split_by_hash
from latentsweep.trainers.eval.submission import write_submission

SECRET = "s3cr3t-pw"
PG_WITH_PASSWORD = f"postgresql+psycopg2://user:{SECRET}@127.0.0.1:1/x"  # port 1: refused at once

# ---- study-file variants: (replace this, with that) in the good study file; each has one problem -----------------

STUDY_VARIANTS = {
    "name_traversal": ('name = "badinput"', 'name = "../../escape"'),
    "name_slash": ('name = "badinput"', 'name = "a/b"'),
    "name_dotdot": ('name = "badinput"', 'name = ".."'),
    "name_too_long": ('name = "badinput"', f'name = "{"x" * 150}"'),
    "name_newline": ('name = "badinput"', 'name = "a\\nb"'),
    "timeout_nan": ("n_trials = 1", "n_trials = 1\ntimeout = nan"),
    "timeout_inf": ("n_trials = 1", "n_trials = 1\ntimeout = inf"),
    "timeout_negative": ("n_trials = 1", "n_trials = 1\ntimeout = -5"),
    "timeout_bool": ("n_trials = 1", "n_trials = 1\ntimeout = true"),
    "n_trials_zero": ("n_trials = 1", "n_trials = 0"),
    "n_trials_float": ("n_trials = 1", "n_trials = 2.5"),
    "startup_negative": ('pruner = "none"', 'pruner = "none"\nsampler = { name = "tpe", n_startup_trials = -1 }'),
    "startup_string": ('pruner = "none"', 'pruner = "none"\nsampler = { name = "tpe", n_startup_trials = "ten" }'),
    "sampler_seed_huge": ('pruner = "none"', 'pruner = "none"\nsampler = { name = "tpe", seed = 1099511627776 }'),
    "sampler_seed_negative": ('pruner = "none"', 'pruner = "none"\nsampler = { name = "random", seed = -1 }'),
    "sampler_not_table": ('pruner = "none"', 'pruner = "none"\nsampler = 3'),
    "pruner_percentile": ('pruner = "none"', 'pruner = { name = "percentile", percentile = 150.0 }'),
    "pruner_warmup_negative": ('pruner = "none"', 'pruner = { name = "median", n_warmup_steps = -1 }'),
    "pruner_bool_count": ('pruner = "none"', 'pruner = { name = "median", n_startup_trials = true }'),
    "direction_typo": ("n_trials = 1", 'n_trials = 1\ndirection = "maximise"'),
    "width_huge": ("hidden = [16]", "hidden = [10000000000]"),
    "width_zero": ("hidden = [16]", "hidden = [0]"),
    "train_seed_huge": ("epochs = 1", "epochs = 1\nseed = 99999999999"),
    "lr_nan": ("[base.train]", "[base.optim]\nlr = nan\n\n[base.train]"),
    "unknown_table": ("[base.data]", "[bogus]\nx = 1\n\n[base.data]"),
    "unknown_setting": ("n_trials = 1", 'n_trials = 1\ndescripton = "typo"'),
    "space_bad_type": ('type = "float"', 'type = "floot"'),
}
STUDY_VARIANT_FRAGMENTS = {
    "name_traversal": "study.name '../../escape' is not allowed", "name_slash": "study.name 'a/b' is not allowed",
    "name_dotdot": "study.name '..' is not allowed", "name_too_long": "is not allowed",
    "name_newline": "is not allowed", "timeout_nan": "study.timeout", "timeout_inf": "study.timeout",
    "timeout_negative": "study.timeout", "timeout_bool": "study.timeout", "n_trials_zero": "study.n_trials",
    "n_trials_float": "study.n_trials", "startup_negative": "n_startup_trials: must be >= 0, got -1",
    "startup_string": "n_startup_trials: expected a whole number", "sampler_seed_huge": "Seed must be between",
    "sampler_seed_negative": "Seed must be between", "sampler_not_table": "expected a name or a table",
    "pruner_percentile": "Percentile must be between 0 and 100", "pruner_warmup_negative": "n_warmup_steps",
    "pruner_bool_count": "expected a whole number, got True", "direction_typo": "study.direction",
    "width_huge": "above the maximum 65536", "width_zero": "below the minimum 1",
    "train_seed_huge": "above the maximum 4294967295", "lr_nan": "optim.lr", "unknown_table": "unknown table [bogus]",
    "unknown_setting": "did you mean 'description'", "space_bad_type": "type must be one of",
}

# Variants that pass the file check but not the pre-run checks: one plain error line before any trial.
PREFLIGHT_VARIANTS = {
    "direction_mismatch": ("n_trials = 1", 'n_trials = 1\ndirection = "minimize"'),
    "distribution_kind": ('{ type = "float", low = 1e-4, high = 1e-2, log = true }',
                          '{ type = "categorical", choices = [0.001, 0.01] }'),
    "distribution_log": ("log = true", "log = false"),
    "objective_unknown": ("n_trials = 1", 'n_trials = 1\nobjective = "val/mmr"'),
    "objective_not_val": ("n_trials = 1", 'n_trials = 1\nobjective = "loss"'),
    "device_bogus": ("epochs = 1", 'epochs = 1\ndevice = "gpu"'),
    "device_meta": ("epochs = 1", 'epochs = 1\ndevice = "meta"'),
    "device_absent": ("epochs = 1", 'epochs = 1\ndevice = "cuda:999"'),
}
# Names the trainer's validation rejects for every config, so the study-file check lists them (header + problems).
STUDY_FILE_CASES = {"device_bogus", "device_meta"}
PREFLIGHT_FRAGMENTS = {
    "direction_mismatch": "stored with direction maximize",
    "distribution_kind": "Cannot set different distribution kind",
    "distribution_log": "Cannot set different log configuration", "objective_unknown": "did you mean 'val/mrr'",
    "objective_not_val": "study.objective 'loss' is not a metric", "device_bogus": "train.device='gpu'",
    "device_meta": "train.device='meta'", "device_absent": "cuda:999",
}


def _variant(root: Path, name: str, replace: tuple[str, str]) -> Path:
    old, new = replace
    assert old in GOOD_STUDY, old
    path = root / f"{name}.toml"
    path.write_text(GOOD_STUDY.replace(old, new, 1))
    return path


# ---- hostile files -------------------------------------------------------------------------------------------------

def _npz(src: Path, dst: Path, change) -> Path:
    arrays = dict(np.load(src))
    change(arrays)
    np.savez(dst, **arrays)
    return dst


def _no_val_captions(arrays):
    """Move every caption of a validation image to the first training image: the data checks pass (images may have
    no caption) but the split leaves nothing to validate on."""
    _, val = split_by_hash(arrays["images/names"], 0.25)
    label = arrays["captions/label"]
    rows = np.flatnonzero(label[:, val].any(1))
    train_image = np.setdiff1d(np.arange(label.shape[1]), val)[0]
    label[rows] = False
    label[rows, train_image] = True


def _hostile_header(src: Path, dst: Path, raw: bytes) -> Path:
    """Replace captions/embeddings' .npy bytes (header and data) by `raw`; every other member stays good."""
    import io
    import zipfile

    with zipfile.ZipFile(dst, "w") as out:
        for key, value in np.load(src).items():
            buf = io.BytesIO()
            np.save(buf, value)
            out.writestr(f"{key}.npy", raw if key == "captions/embeddings" else buf.getvalue())
    return dst


def _npy(shape, descr: str = "<f4", data: bytes = b"\0" * 64) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


HOSTILE_HEADERS = {  # name: .npy bytes of captions/embeddings
    "hdr_huge_shape": _npy((10**12, 8)),  # numpy would try to allocate 32 TB
    "hdr_negative_shape": _npy((-5, 8)),
    "hdr_code": b"\x93NUMPY\x01\x00" + (38).to_bytes(2, "little") + b"{'descr': __import__('os').getcwd()}   \n",
    "hdr_object": _npy((3, 8), descr="|O"),
    "hdr_short_data": _npy((40, 8), data=b"\0" * 12),
}


class Payload:
    """A checkpoint that would run code when unpickled without weights_only."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('HOSTILE_MARKER', '/nonexistent/marker')}",))


@pytest.fixture(scope="session")
def hostile(tmp_path_factory, data, existing) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hostile")
    train = data["train"]
    files = {"train": train, "test": data["test"], "answers": train.parent / "answers.npz",
             "study": existing["study_file"], "state": existing["state"], "ckpt": existing["checkpoint"],
             "marker": out / "pickle-ran"}
    files["dup_ids"] = _npz(train, out / "dup_ids.npz",
                            lambda a: a["captions/ids"].__setitem__(5, a["captions/ids"][2]))
    files["dup_names"] = _npz(train, out / "dup_names.npz",
                              lambda a: a["images/names"].__setitem__(7, a["images/names"][3]))
    files["ids_uint64"] = _npz(train, out / "ids_uint64.npz", lambda a: a.update(
        {"captions/ids": np.arange(len(a["captions/ids"]), dtype=np.uint64) + np.uint64(2**63)}))
    files["object_text"] = _npz(train, out / "object_text.npz", lambda a: a.update(
        {"captions/text": np.array(list(a["captions/text"]), dtype=object)}))
    files["no_val_captions"] = _npz(train, out / "no_val_captions.npz", _no_val_captions)
    for name, raw in HOSTILE_HEADERS.items():
        files[name] = _hostile_header(train, out / f"{name}.npz", raw)
    (out / "empty.npz").write_bytes(b"")
    files["empty"] = out / "empty.npz"
    payload = torch.load(existing["checkpoint"], map_location="cpu", weights_only=True)
    for name, change in {"ckpt_bad_config": lambda p: p["config"]["model"].update(kind="nonexistent"),
                         "ckpt_no_config": lambda p: p.pop("config"),
                         "ckpt_shapes": lambda p: p.update(dim_in=p["dim_in"] + 3),
                         "ckpt_not_dict": lambda p: p.clear()}.items():
        variant = {k: (dict(v) if isinstance(v, dict) else v) for k, v in payload.items()}
        variant["config"] = {k: dict(v) for k, v in payload["config"].items()}
        change(variant)
        files[name] = out / f"{name}.pt"
        torch.save(variant if variant else [1, 2, 3], files[name])
    os.environ["HOSTILE_MARKER"] = str(files["marker"])
    files["ckpt_pickle"] = out / "pickle.pt"
    torch.save({"format": payload["format"], "x": Payload()}, files["ckpt_pickle"])
    (out / "text.pt").write_text("not a checkpoint\n")
    files["ckpt_text"] = out / "text.pt"
    ids = np.load(data["test"])["captions/ids"]
    good = out / "sub.csv"
    write_submission(good, ids, np.ones((len(ids), 12), np.float32))
    lines = good.read_text().splitlines()
    files["sub"] = good
    for name, text in {"sub_id_overflow": [lines[0], "99999999999999999999" + lines[1][lines[1].index(","):]],
                       "sub_header": ["id,embedding\x00", *lines[1:]], "sub_garbage": ["\x89PNG\r\n\x1a\n\x00\x00"],
                       "sub_empty": [""],
                       "sub_nan": [lines[0], lines[1].replace("[1,", "[nan,", 1), *lines[2:]]}.items():
        files[name] = out / f"{name}.csv"
        files[name].write_text("\n".join(text) + "\n")
    blocker = out / "a_file"
    blocker.write_text("not a directory")
    files["blocker"] = blocker
    for name, replace in {**STUDY_VARIANTS, **PREFLIGHT_VARIANTS}.items():
        files[f"sf_{name}"] = _variant(out, name, replace)
    return files


# ---- the table: (argv with {placeholders}, fragments of the error line, paths that must not exist) ---------------

RUN = ["study", "run", "{study}", "--state-dir", "{state}", "--data", "{train}", "--quiet"]
TRAIN = ["train", "{study}", "--data", "{train}", "--out", "{tmp}/train-out", "--quiet"]
PICK = ["pick", NAME, "--state-dir", "{state}", "--out", "{tmp}/pick/sub.csv", "--quiet"]
PREDICT = ["predict", "{ckpt}", "--test", "{test}", "--out", "{tmp}/pred.csv"]

CASES = {
    # numbers and names on the command line
    "n_trials_zero": (RUN + ["--n-trials", "0"], ["--n-trials must be >= 1, got 0"], []),
    "n_trials_negative": (RUN + ["--n-trials", "-3"], ["--n-trials must be >= 1, got -3"], []),
    "n_trials_text": (RUN + ["--n-trials", "ten"], ["study run: argument --n-trials", "'ten'"], []),
    "timeout_negative": (RUN + ["--timeout", "-1"], ["--timeout must be a positive"], []),
    "timeout_nan": (RUN + ["--timeout", "nan"], ["--timeout must be a positive", "nan"], []),
    "timeout_inf": (RUN + ["--timeout", "inf"], ["--timeout must be a positive", "inf"], []),
    "timeout_zero": (RUN + ["--timeout", "0"], ["--timeout must be a positive"], []),
    "workers_zero": (RUN + ["--workers", "0"], ["--workers must be >= 1"], []),
    "heartbeat_zero": (RUN + ["--heartbeat", "0"], ["--heartbeat at least 1 s"], []),
    "grace_short": (RUN + ["--heartbeat", "5", "--grace", "5"], ["--grace (5 s) must be longer"], []),
    "unknown_option": (RUN + ["--bogus"], ["unrecognized arguments: --bogus"], []),
    "name_traversal": (RUN + ["--name", "../escape"], ["--name '../escape' is not allowed"], ["{state}/escape"]),
    "name_absolute": (RUN + ["--name", "/tmp/abs"], ["--name '/tmp/abs' is not allowed"], []),
    "name_empty": (RUN + ["--name", ""], ["--name '' is not allowed"], []),
    "name_hidden": (RUN + ["--name", ".hidden"], ["--name '.hidden' is not allowed"], []),
    "name_long": (RUN + ["--name", "n" * 300], ["is not allowed"], []),
    "name_reap": (["study", "reap", "../x", "--state-dir", "{state}"], ["is not allowed"], []),
    "name_worker": (["worker", "{study}", "--state-dir", "{state}", "--data", "{train}", "--name", "a/../../b"],
                    ["is not allowed"], []),
    # stores and paths
    "tracking_db_unreachable": (RUN + ["--tracking-uri", PG_WITH_PASSWORD],
                                ["MLflow tracking store postgresql+psycopg2://user:***@127.0.0.1:1/x is not reachable"],
                                []),
    "tracking_sqlite_no_dir": (RUN + ["--tracking-uri", "sqlite:////nonexistent/dir/mlflow.db"],
                               ["directory /nonexistent/dir does not exist"], ["/nonexistent/dir"]),
    "storage_password": (RUN + ["--storage", PG_WITH_PASSWORD], ["cannot open Optuna storage", "***"], []),
    "storage_not_url": (RUN + ["--storage", "not a url"], ["cannot open Optuna storage"], []),
    "artifact_root_blocked": (RUN + ["--artifact-root", "{blocker}/artifacts"], ["--artifact-root"], []),
    "data_missing": (RUN[:-3] + ["--data", "{tmp}/nope.npz", "--quiet"], ["nope.npz: file not found"], []),
    "data_directory": (RUN[:-3] + ["--data", "{tmp}", "--quiet"], ["file not found"], []),
    "state_below_file": (["study", "run", "{study}", "--state-dir", "{blocker}/state", "--data", "{train}"],
                         ["is not writable"], []),
    "status_missing_state": (["study", "status", NAME, "--state-dir", "{tmp}/none"], ["no Optuna storage"],
                             ["{tmp}/none"]),
    "status_unknown_study": (["study", "status", "nosuch", "--state-dir", "{state}"], ["no study named 'nosuch'"],
                             []),
    # data files that load but are wrong
    "dup_caption_ids": (["data", "check", "{dup_ids}"], ["'captions/ids'", "row 5 repeats id"], []),
    "dup_image_names": (["data", "check", "{dup_names}"], ["'images/names'", "rows 3 and 7 both name image"], []),
    "ids_above_int64": (["data", "check", "{ids_uint64}"], ["above the int64 maximum"], []),
    "object_array": (["data", "check", "{object_text}"], ["'captions/text'", "allow_pickle=False"], []),
    "empty_npz": (["data", "check", "{empty}"], ["not a readable npz"], []),
    "hdr_huge_shape": (["data", "check", "{hdr_huge_shape}"], ["header declares shape (1000000000000, 8)"], []),
    "hdr_negative_shape": (["data", "check", "{hdr_negative_shape}"], ["header declares shape (-5, 8)"], []),
    "hdr_code": (["data", "check", "{hdr_code}"], ["'captions/embeddings'", "cannot read"], []),
    "hdr_object": (["data", "check", "{hdr_object}"], ["allow_pickle=False"], []),
    "hdr_short_data": (["data", "check", "{hdr_short_data}"], ["but the member holds 12 data bytes"], []),
    "run_hdr_huge_shape": (RUN[:-3] + ["--data", "{hdr_huge_shape}", "--quiet"], ["header declares shape"], []),
    "train_hdr_huge_shape": (["train", "{study}", "--data", "{hdr_huge_shape}", "--out", "{tmp}/o", "--quiet"],
                             ["header declares shape"], ["{tmp}/o"]),
    "run_dup_names": (RUN[:-3] + ["--data", "{dup_names}", "--quiet"], ["both name image"], []),
    "run_no_val_captions": (RUN[:-3] + ["--data", "{no_val_captions}", "--quiet"],
                            ["leaves the validation images without any caption"], []),
    "worker_no_val_captions": (["worker", "{study}", "--state-dir", "{state}", "--data", "{no_val_captions}"],
                               ["without any caption"], []),
    # train: everything checked before the output directory exists
    "train_device": (TRAIN + ["--set", "train.device=gpu"], ["train.device='gpu'"], ["{tmp}/train-out"]),
    "train_device_index": (TRAIN + ["--set", "train.device=cuda:999"], ["cuda:999"], ["{tmp}/train-out"]),
    "train_seed_huge": (TRAIN + ["--seed", "99999999999"], ["train.seed", "above the maximum"], ["{tmp}/train-out"]),
    "train_seed_negative": (TRAIN + ["--seed", "-1"], ["train.seed", "below the minimum"], ["{tmp}/train-out"]),
    "train_width_huge": (TRAIN + ["--set", "model.hidden=[99999999999]"], ["model.hidden"], ["{tmp}/train-out"]),
    "train_lr_nan": (TRAIN + ["--set", "optim.lr=nan"], ["optim.lr"], ["{tmp}/train-out"]),
    "train_epochs_zero": (TRAIN + ["--epochs", "0"], ["train.epochs"], ["{tmp}/train-out"]),
    "train_unknown_key": (TRAIN + ["--set", "optim.learning_rate=1"], ["unknown config key"], ["{tmp}/train-out"]),
    "train_no_split": (["train", "{study}", "--data", "{no_val_captions}", "--out", "{tmp}/train-out", "--quiet"],
                       ["without any caption"], ["{tmp}/train-out"]),
    "train_out_below_file": (TRAIN[:-3] + ["--out", "{blocker}/out", "--quiet"], ["a_file"], []),
    "train_gallery_zero": (TRAIN + ["--set", "eval.gallery_size=0"], ["eval.gallery_size"], ["{tmp}/train-out"]),
    # checkpoints
    "predict_bad_config": (["predict", "{ckpt_bad_config}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                           ["ckpt_bad_config.pt", "checkpoint config is invalid"], ["{tmp}/p.csv"]),
    "predict_no_config": (["predict", "{ckpt_no_config}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                          ["does not match its config", "KeyError"], ["{tmp}/p.csv"]),
    "predict_shapes": (["predict", "{ckpt_shapes}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                       ["does not match its config"], ["{tmp}/p.csv"]),
    "predict_not_dict": (["predict", "{ckpt_not_dict}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                         ["not a latentsweep checkpoint"], ["{tmp}/p.csv"]),
    "predict_pickle": (["predict", "{ckpt_pickle}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                       ["pickle.pt"], ["{tmp}/p.csv", "{marker}"]),
    "predict_text": (["predict", "{ckpt_text}", "--test", "{test}", "--out", "{tmp}/p.csv"],
                     ["not a readable latentsweep checkpoint"], ["{tmp}/p.csv"]),
    "predict_out_missing_dir": (PREDICT[:-1] + ["{tmp}/no/such/dir/p.csv"], ["No such file or directory"],
                                ["{tmp}/no"]),
    "predict_out_is_dir": (PREDICT[:-1] + ["{tmp}"], ["Is a directory"], []),
    "predict_test_missing": (["predict", "{ckpt}", "--test", "{tmp}/t.npz", "--out", "{tmp}/p.csv"],
                             ["file not found"], ["{tmp}/p.csv"]),
    # pick
    "pick_traversal": (["pick", "../../etc", "--state-dir", "{state}", "--quiet"], ["is not allowed"], []),
    "pick_device": (PICK + ["--device", "gpu"], ["device 'gpu' is not one of"], ["{tmp}/pick"]),
    "pick_device_index": (PICK + ["--device", "cuda:999"], ["cuda:999"], ["{tmp}/pick"]),
    "pick_top_zero": (PICK + ["--top", "0"], ["--top must be >= 1"], ["{tmp}/pick"]),
    "pick_size_zero": (PICK + ["--size", "0"], ["--size must be >= 1"], ["{tmp}/pick"]),
    "pick_seeds_negative": (PICK + ["--seeds", "-1"], ["--seeds must be >= 1"], ["{tmp}/pick"]),
    "pick_unknown_study": (["pick", "nosuch", "--state-dir", "{state}", "--out", "{tmp}/p.csv"],
                           ["no study named 'nosuch'"], ["{tmp}/p.csv"]),
    "pick_missing_state": (["pick", NAME, "--state-dir", "{tmp}/none"], ["no Optuna storage"], ["{tmp}/none"]),
    "pick_out_below_file": (["pick", NAME, "--state-dir", "{state}", "--out", "{blocker}/x/sub.csv"],
                            ["is not a directory"], []),
    "pick_method": (PICK + ["--method", "best"], ["argument --method", "invalid choice"], ["{tmp}/pick"]),
    # submissions
    "score_gallery_zero": (["submission", "score", "{sub}", "--answers", "{answers}", "--gallery-size", "0"],
                           ["gallery size must be a whole number >= 2", "got 0"], []),
    "score_gallery_negative": (["submission", "score", "{sub}", "--answers", "{answers}", "--gallery-size", "-5"],
                               ["got -5"], []),
    "check_id_overflow": (["submission", "check", "{sub_id_overflow}", "--test", "{test}"],
                          ["line 2", "outside the int64 range"], []),
    "check_header_nul": (["submission", "check", "{sub_header}", "--test", "{test}"], ["line 1: header"], []),
    "check_binary": (["submission", "check", "{sub_garbage}", "--test", "{test}"], ["sub_garbage.csv"], []),
    "check_empty": (["submission", "check", "{sub_empty}", "--test", "{test}"], ["sub_empty.csv"], []),
    "check_nan": (["submission", "check", "{sub_nan}", "--test", "{test}"], ["sub_nan.csv", "line 2"], []),
    "check_dim_text": (["submission", "check", "{sub}", "--test", "{test}", "--dim", "x"], ["argument --dim"], []),
    # ui: rejected before any server starts
    "ui_port_zero": (["ui", "--state-dir", "{state}", "--mlflow-port", "0"], ["port 0 is outside 1-65535"], []),
    "ui_port_huge": (["ui", "--state-dir", "{state}", "--dashboard-port", "70000"], ["port 70000 is outside"], []),
    "ui_port_negative": (["ui", "--state-dir", "{state}", "--mlflow-port", "-1"], ["port -1 is outside"], []),
    "ui_port_text": (["ui", "--state-dir", "{state}", "--mlflow-port", "http"], ["invalid port 'http'"], []),
    "ui_timeout_nan": (["ui", "--state-dir", "{state}", "--timeout", "nan"], ["positive number of seconds"], []),
    "ui_timeout_zero": (["ui", "--state-dir", "{state}", "--timeout", "0"], ["positive number of seconds"], []),
}


def fill(argv: list[str], files: dict[str, Path], tmp: Path) -> list[str]:
    return [a.format(tmp=tmp, **files) for a in argv]


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_command_is_rejected_cleanly(case, hostile, existing, tmp_path, capsys):
    argv, fragments, absent = CASES[case]
    line = assert_rejected(capsys, main(fill(argv, hostile, tmp_path)), existing, *fragments,
                           absent=fill(absent, hostile, tmp_path), secrets=[SECRET])
    assert "Traceback" not in line


@pytest.mark.parametrize("case", sorted(STUDY_VARIANTS))
def test_hostile_study_file_is_rejected_before_anything_runs(case, hostile, existing, tmp_path, capsys):
    path = hostile[f"sf_{case}"]
    out = tmp_path / "train-out"
    code = main(["study", "run", str(path), "--state-dir", str(existing["state"]), "--data", str(hostile["train"])])
    (problem,) = problem_lines(capsys, code, path)
    assert STUDY_VARIANT_FRAGMENTS[case] in problem
    (problem,) = problem_lines(capsys, main(["train", str(path), "--out", str(out), "--quiet"]), path)
    assert not out.exists() and not (existing["state"].parent / "escape").exists()
    assert snapshot(existing["state"]) == existing["before"]


@pytest.mark.parametrize("case", sorted(PREFLIGHT_VARIANTS))
@pytest.mark.parametrize("command", ["run", "worker"])
def test_stored_study_and_run_checks_come_before_the_first_trial(case, command, hostile, existing, capsys):
    head = ["worker"] if command == "worker" else ["study", "run"]
    argv = [*head, str(hostile[f"sf_{case}"]), "--state-dir", str(existing["state"]), "--data", str(hostile["train"])]
    if case in STUDY_FILE_CASES:  # the study-file check (every branch validated) catches these even earlier
        problems = problem_lines(capsys, main(argv), hostile[f"sf_{case}"])
        assert any(PREFLIGHT_FRAGMENTS[case] in line for line in problems), problems
        assert snapshot(existing["state"]) == existing["before"]
        return
    assert_rejected(capsys, main(argv), existing, PREFLIGHT_FRAGMENTS[case])

