"""`latentsweep pick`: selection on the select half only, honest report-half figures, all-or-nothing outputs, the MLflow
run and pyfunc model (reproducing the submission, registered), and one-line errors that leave no files."""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import TrialState
import pandas as pd
import pytest
from mlflow import MlflowClient

from latentsweep.search.pick import candidates, ensemble
from latentsweep.search.cli.main import main
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_test, load_train
from latentsweep.trainers.data.writer import write_test_npz
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.eval.metrics import evaluate_leaderboard
from latentsweep.trainers.eval.submission import check_submission, read_submission
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import split_images

STUDY = "tiny"
TINY_STUDY = f"""
[study]
name = "{STUDY}"
n_trials = 4
sampler = {{ name = "tpe", seed = 0, n_startup_trials = 4 }}
pruner = {{ name = "none" }}

[base.data]
split = "hash"
val_ratio = 0.2

[base.model]
kind = "mlp"
hidden = [64]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = 2
batch_size = 256

[space]
"optim.lr" = {{ type = "float", low = 2e-4, high = 3e-3, log = true }}
"temperature.tau" = {{ type = "float", low = 0.02, high = 0.2, log = true }}
"model.dropout" = {{ type = "float", low = 0.0, high = 0.5 }}
"""
# Names MLflow's and Optuna's SQLite connections create and remove as they please (not outputs of the command).
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


# ---------------------------------------------------------------------------------------------- fast unit tests

def test_halves_split_images_not_captions_and_are_disjoint(tmp_path):
    train, _, _ = write_synthetic(tmp_path, 120, dim_text=8, dim_image=12, n_test=0)
    data = load_train(train)
    _, val = split_images(with_values(Config(), {"data.val_ratio": 0.5}), data)
    select, report = ensemble.split_halves(val, data.image_names, data.cap2img)
    assert not set(select.images) & set(report.images)
    assert not set(select.captions) & set(report.captions)
    assert sorted(np.concatenate([select.images, report.images])) == sorted(val)
    assert abs(len(select.images) - len(report.images)) <= 1
    for half in (select, report):
        assert set(data.cap2img[half.captions]) == set(half.images)  # every caption of each image, no other
        assert (half.images[half.cap2local] == data.cap2img[half.captions]).all()
        assert half.gallery_size == min(100, len(half.images))
    again = ensemble.split_halves(val[::-1], data.image_names, data.cap2img)
    assert (again[0].images == select.images).all()  # deterministic, independent of the order given


def test_combine_is_normalised_weighted_mean_of_normalised_outputs():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 4)) * 10, rng.standard_normal((5, 4))
    out = ensemble.combine([a, b], [0.25, 0.75])
    expected = 0.25 * ensemble.l2n(a) + 0.75 * ensemble.l2n(b)
    assert np.allclose(out, expected / np.linalg.norm(expected, axis=1, keepdims=True), atol=1e-6)
    assert np.allclose(ensemble.combine([a, b], [1.0, 0.0]), ensemble.l2n(a), atol=1e-6)


def _noisy_members(n_members: int, seed: int = 0):
    """Members = truth + independent noise: averaging helps, so greedy should pick several."""
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((60, 16)).astype(np.float32)
    outs = [truth + rng.standard_normal(truth.shape).astype(np.float32) * (1.5 + 0.2 * i) for i in range(n_members)]
    cap2img = np.arange(60)
    return truth, outs, lambda p: evaluate_leaderboard(p, truth, cap2img, gallery_size=60)["mrr"]


def test_greedy_starts_from_best_single_and_never_loses_on_its_own_data():
    _, outs, mrr = _noisy_members(5)
    normed = [ensemble.l2n(o) for o in outs]
    singles = [mrr(o) for o in normed]
    counts = ensemble.greedy_counts(normed, mrr, size=8)
    assert counts[int(np.argmax(singles))] >= 1 and 1 <= counts.sum() <= 8
    weights = ensemble.method_weights("greedy", outs, mrr, 8)
    assert weights.sum() == pytest.approx(1.0)
    assert mrr(ensemble.combine(outs, weights)) >= max(singles)
    assert (counts > 0).sum() > 1  # independent noise: a second member helps
    assert ensemble.greedy_counts(normed, mrr, size=1).sum() == 1


def test_one_member_gets_weight_one_without_being_scored():
    """One member's weight is 1 by every method: chosen without normalising a copy or scoring a greedy step (each an
    [N, D] copy, 0.15 GB at challenge size, and a validation's time)."""
    def unscored(_):
        raise AssertionError("scored")

    _, outs, mrr = _noisy_members(1)
    for method in ensemble.METHODS:
        assert ensemble.method_weights(method, outs, unscored, 8).tolist() == [1.0]
    counts = ensemble.greedy_counts([ensemble.l2n(outs[0])], mrr, 8)  # what greedy chose by scoring
    assert (counts / counts.sum()).tolist() == [1.0]


def test_mean_and_weighted_weights():
    _, outs, mrr = _noisy_members(3)
    assert np.allclose(ensemble.method_weights("mean", outs, mrr, 10), 1 / 3)
    weighted = ensemble.method_weights("weighted", outs, mrr, 10)
    singles = np.array([mrr(ensemble.l2n(o)) for o in outs])
    assert np.allclose(weighted, singles / singles.sum())
    with pytest.raises(LatentsweepError, match="--method"):
        ensemble.method_weights("best", outs, mrr, 10)


def test_missing_checkpoint_is_skipped_with_a_warning_naming_the_trial(tmp_path, capsys):
    from latentsweep.search.tracking import make_tracker

    tracker = make_tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"))
    tracker.open_experiment("s")
    run_id = tracker.start_run("trial-7", {})  # a real run that never logged best.pt
    tracker.end_run(run_id)
    trial = types.SimpleNamespace(number=7, user_attrs={"checkpoint": str(tmp_path / "gone" / "best.pt"),
                                                        "mlflow_run_id": run_id})
    assert candidates.fetch_checkpoint(trial, tracker, tmp_path / "downloads", tmp_path) is None
    err = capsys.readouterr().err
    # the local path is missing, then the download from the tracked run is tried and fails: both are said
    assert "trial 7" in err and "gone" in err and run_id in err and "has no best.pt" in err


def test_candidates_must_share_the_val_split():
    def cand(name, **values):
        cfg = with_values(Config(), values)
        return candidates.Candidate(name, 0, Path("x"), cfg, (4, 6), 0.5, None, "local", None)

    candidates.check_agreement([cand("a"), cand("b")], same_split=True)
    with pytest.raises(LatentsweepError, match=r"data.val_ratio"):
        candidates.check_agreement([cand("a"), cand("b", **{"data.val_ratio": 0.3})], same_split=True)
    with pytest.raises(LatentsweepError, match=r"data.salt"):
        candidates.check_agreement([cand("a"), cand("b", **{"data.salt": "x"})], same_split=True)
    # out-of-fold selection retrains every candidate on the same folds: the study's splits may differ
    candidates.check_agreement([cand("a"), cand("b", **{"data.val_ratio": 0.3})], same_split=False)


# ---------------------------------------------------------------------------------------------- a real tiny study

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Synthetic data + a 4-trial, 2-epoch study run through the real CLI (Optuna + MLflow on SQLite)."""
    root = tmp_path_factory.mktemp("pick")
    train, test, _ = write_synthetic(root / "data", 300, dim_text=32, dim_image=48, n_test=100)
    study_file = root / "tiny.toml"
    study_file.write_text(TINY_STUDY)
    state = root / "state"
    assert main(["study", "run", str(study_file), "--state-dir", str(state), "--n-trials", "4",
                 "--data", str(train), "--quiet"]) == 0
    return types.SimpleNamespace(root=root, state=state, train=train, test=test,
                                 tracking=f"sqlite:///{state / 'mlflow.db'}",
                                 storage=f"sqlite:///{state / 'optuna.db'}")


@pytest.fixture(scope="module")
def greedy_pick(world):
    out = world.root / "picked" / "submission.csv"
    code = main(["pick", STUDY, "--state-dir", str(world.state), "--top", "4", "--register", "tiny-ensemble",
                 "--out", str(out), "--selection", "halves", "--no-refit", "--quiet"])
    assert code == 0
    return out, json.loads(out.with_name("submission.manifest.json").read_text())


@pytest.mark.slow
def test_pick_writes_a_valid_submission_manifest_and_report(world, greedy_pick):
    out, manifest = greedy_pick
    test = load_test(world.test)
    assert check_submission(out, test, dim=48) == (100, 48)
    assert manifest["study"] == STUDY and manifest["method"] == "greedy"
    assert manifest["test"]["path"] == str(world.test)  # found beside the train file the trials recorded
    assert manifest["data"]["fingerprint"] == load_train(world.train).fingerprint
    assert len(manifest["members"]) == 4
    for member in manifest["members"]:
        assert Path(member["checkpoint"]).is_file() and len(member["config_sha256"]) == 64
    report = pd.read_csv(out.with_name("submission.report.csv"))
    assert set(report["role"]) == {"member", "best_single", "mean", "ensemble", "submission_model"}
    made = report[report["role"] == "submission_model"]
    assert set(made["origin"]) == {"local"} and made["weight"].sum() == pytest.approx(1.0)  # --no-refit
    # no staging left behind (latentsweep.trainers.core.io.atomic_path: hidden, beside)
    assert not list(out.parent.glob(".*"))


@pytest.mark.slow
def test_greedy_weights_sum_to_one_and_do_not_lose_on_the_select_half(world, greedy_pick):
    _, manifest = greedy_pick
    assert sum(manifest["weights"].values()) == pytest.approx(1.0)
    select = manifest["scores"]["select"]
    assert select["ensemble"]["mrr"] >= select["best_single"]["mrr"]
    best = max(manifest["members"], key=lambda m: m["select_mrr"])
    assert manifest["best_single"] == best["name"]  # chosen on the select half, not the report half
    report = manifest["scores"]["report"]
    gain = report["ensemble"]["mrr"] - report["best_single"]["mrr"]
    assert manifest["scores"]["gain_report_mrr"] == pytest.approx(gain)
    halves = manifest["halves"]
    _, val = split_images(with_values(Config(), {"data.val_ratio": 0.2}), load_train(world.train))
    assert halves["select"]["images"] + halves["report"]["images"] == len(val)


@pytest.mark.slow
def test_mlflow_run_pyfunc_model_reproduces_the_submission_and_is_registered(world, greedy_pick, monkeypatch):
    import mlflow

    out, manifest = greedy_pick
    client = MlflowClient(world.tracking)
    run = client.get_run(manifest["mlflow"]["run_id"])
    assert run.info.run_name == "pick-greedy" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == STUDY
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "submission.csv", "submission.manifest.json", "submission.report.csv"}
    assert run.data.metrics["report/ensemble_mrr"] == pytest.approx(manifest["scores"]["report"]["ensemble"]["mrr"])
    assert run.data.metrics["gain_mrr"] == pytest.approx(manifest["gain_mrr"])
    versions = client.search_model_versions("name='tiny-ensemble'")
    assert [v.version for v in versions] == [int(manifest["mlflow"]["registered"]["version"])]
    assert versions[0].run_id == run.info.run_id

    monkeypatch.setenv("MLFLOW_TRACKING_URI", world.tracking)  # models:/ URIs resolve through the global URI
    ids, vectors = read_submission(out)
    test = load_test(world.test)
    assert (ids == test.ids).all()
    for uri in (manifest["mlflow"]["model_uri"], "models:/tiny-ensemble/1"):
        pred = mlflow.pyfunc.load_model(uri).predict(test.embeddings)
        assert pred.shape == (100, 48) and pred.dtype == np.float32
        assert np.allclose(pred, vectors, atol=1e-5)


@pytest.mark.slow
def test_an_export_that_cannot_finish_before_the_deadline_creates_no_model(world, tmp_path):
    """The members' export starts only when the plan's estimate fits before the deadline (a one-budget job's last
    seconds): otherwise nothing is exported and nothing is created in the store, not even a FAILED model."""
    from latentsweep.search.pick.plan import MODEL_EXPORT_S
    from latentsweep.search.pick.pyfunc_model import ModelCard, log_ensemble, stage_members
    from latentsweep.search.tracking import make_tracker
    from latentsweep.trainers.core.deadline import Deadline

    checkpoints = sorted(world.state.glob("**/best.pt"))[:2]
    pairs, weights = [(f"m{i}", p) for i, p in enumerate(checkpoints)], np.array([0.5, 0.5])
    assert stage_members(tmp_path / "late", pairs, weights, Deadline.after(MODEL_EXPORT_S - 1)) is None
    assert not list((tmp_path / "late").glob("*.pt2"))
    staged = stage_members(tmp_path / "free", pairs, weights, Deadline.never())
    assert sorted(p.name for p in staged.glob("*.pt2")) == ["member-00.pt2", "member-01.pt2"]

    client = MlflowClient(world.tracking)
    exp = client.get_experiment_by_name(STUDY).experiment_id
    before = len(client.search_logged_models([exp]))
    tracker = make_tracker(world.tracking)
    run_id = client.create_run(exp).info.run_id
    card = ModelCard("late-ensemble", {}, {}, {}, "")
    members = [(name, path, 0.5) for name, path in pairs]
    assert log_ensemble(tracker, run_id, members, (32, 48), card, deadline=Deadline.after(0.0)) is None
    assert len(client.search_logged_models([exp])) == before


@pytest.mark.slow
def test_seed_reruns_weighted_and_checkpoint_download(world):
    """--seeds retrains the best configs; a trial whose local best.pt is gone is fetched from its MLflow run."""
    study = optuna.load_study(study_name=STUDY, storage=world.storage)
    best = sorted(study.trials, key=lambda t: -t.value)[0]
    local = world.state / best.user_attrs["checkpoint"]  # relative to the state directory
    hidden = local.with_name("best.pt.hidden")
    shutil.move(local, hidden)
    try:
        out = world.root / "seeds" / "sub.csv"
        assert main(["pick", STUDY, "--state-dir", str(world.state), "--top", "2", "--seeds", "1",
                     "--method", "weighted", "--out", str(out), "--selection", "halves", "--no-refit",
                     "--quiet"]) == 0
    finally:
        shutil.move(hidden, local)
    manifest = json.loads(out.with_name("sub.manifest.json").read_text())
    members = {m["name"]: m for m in manifest["members"]}
    assert members[f"trial-{best.number}"]["origin"].startswith(f"runs:/{best.user_attrs['mlflow_run_id']}")
    seeded = [m for m in members.values() if "/seed-" in m["name"]]
    assert len(seeded) == 2 and all(m["train_seed"] == 1 and m["origin"] == "retrained" for m in seeded)
    assert all(Path(m["checkpoint"]).is_file() for m in seeded)
    mrr = np.array([m["select_mrr"] for m in manifest["members"]])
    weights = np.array([m["weight"] for m in manifest["members"]])
    assert np.allclose(weights, mrr / mrr.sum())


# ---------------------------------------------------------------------------------------------- errors (exit 2)

def _files(*roots: Path) -> set[str]:
    return {str(p) for root in roots if root.exists() for p in root.rglob("*")
            if not str(p).endswith(SQLITE_SIDE_FILES)}


@pytest.mark.slow
def test_errors_exit_2_with_one_line_and_leave_no_files(world, tmp_path, capsys):
    optuna.create_study(study_name="empty", storage=world.storage)
    wide = write_test_npz(tmp_path / "wide.npz", ids=np.arange(1, 11), text=[f"c{i}" for i in range(10)],
                          embeddings=np.ones((10, 16), np.float32))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = [
        (["pick", "nope"], "no study named 'nope'"),
        (["pick", "empty"], "no complete or pruned trial"),
        (["pick", STUDY, "--test", str(wide), "--out", str(tmp_path / "o" / "s.csv")], "has dim 16"),
        (["pick", STUDY, "--out", str(blocker / "s.csv")], "not a directory"),
    ]
    for argv, message in cases:
        before = _files(world.state, tmp_path)
        assert main([*argv, "--state-dir", str(world.state), "--quiet"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("latentsweep: error: ") and message in err[-1], (argv, err)
        assert _files(world.state, tmp_path) == before, argv


# ---------------------------------------------------------------------------------------------- default: oof + refit

@pytest.fixture(scope="module")
def oof_pick(world):
    out = world.root / "oof" / "submission.csv"
    code = main(["pick", STUDY, "--state-dir", str(world.state), "--selection", "oof", "--top", "3", "--folds", "3",
                 "--seeds", "2", "--budget", "none", "--out", str(out), "--quiet"])
    assert code == 0
    return out, json.loads(out.with_name("submission.manifest.json").read_text())


@pytest.mark.slow
def test_default_pick_refits_chosen_members_on_every_image_with_seeds(world, oof_pick):
    from latentsweep.trainers.train.checkpoint import load_model

    out, manifest = oof_pick
    assert manifest["selection"] == "oof" and manifest["folds"] == 3
    chosen = {name for name, w in manifest["weights"].items() if w > 0}
    nested = manifest["nested"]
    # the ensemble is submitted only when its nested gain is above its standard error; else the best single member alone
    assert manifest["ensemble_used"] == (nested["gain_mrr"] > nested["gain_mrr_se"])
    if not manifest["ensemble_used"]:
        assert len(chosen) == 1  # one member alone: greedy's own choice, or the fallback to the best single
    made = manifest["submission_models"]
    # each chosen member: its 3 fold models (bagged, from the selection) and its 2 refit seeds
    assert {m["member"] for m in made} == chosen and len(made) == (3 + 2) * len(chosen)
    assert sum(m["weight"] for m in made) == pytest.approx(1.0)
    assert len({m["weight"] for m in made if m["member"] == next(iter(chosen))}) == 1  # shared equally
    members = {m["name"]: m for m in manifest["members"]}
    data = load_train(world.train)
    for m in made:
        model, cfg, meta = load_model(m["checkpoint"])
        assert cfg.data.split == "all" and cfg.train.stop_after == members[m["member"]]["best_epoch"] + 1
        if m["origin"] == "refit":
            assert meta["data_fingerprint"] == data.fingerprint  # every labelled image, not a subset
        else:
            assert m["origin"] == "fold" and meta["data_fingerprint"].startswith(f"{data.fingerprint}/images-")
    seeds = sorted(load_model(m["checkpoint"])[1].train.seed for m in made if m["origin"] == "refit")
    assert len(seeds) == 2 * len(chosen) and len(set(seeds)) == 2  # two seeds per member
    # the submission is the weighted mean of the refit models' normalised outputs
    test = load_test(world.test)
    preds = [ensemble.predict_all([load_model(m["checkpoint"])[0]], test.embeddings, "cpu")[0] for m in made]
    expected = ensemble.combine(preds, [m["weight"] for m in made])
    assert np.allclose(read_submission(out)[1], expected, atol=1e-5)


@pytest.mark.slow
def test_refits_are_nested_mlflow_runs_with_checkpoints(world, oof_pick):
    _, manifest = oof_pick
    client = MlflowClient(world.tracking)
    pick_run = manifest["mlflow"]["run_id"]
    refits = [m for m in manifest["submission_models"] if m["origin"] == "refit"]
    assert refits and all(m["mlflow_run_id"] is None for m in manifest["submission_models"] if m not in refits)
    for m in refits:
        run = client.get_run(m["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == pick_run and run.info.status == "FINISHED"
        assert "best.pt" in {a.path for a in client.list_artifacts(run.info.run_id)}
    metrics = client.get_run(pick_run).data.metrics
    assert metrics["gain_mrr"] == pytest.approx(manifest["nested"]["gain_mrr"])
    assert len(manifest["nested"]["fold_gains"]) == 3


@pytest.mark.slow
def test_rerun_reuses_finished_jobs_and_budget_drops_are_reported(world, oof_pick, capsys):
    out = world.root / "oof2" / "submission.csv"
    assert main(["pick", STUDY, "--state-dir", str(world.state), "--selection", "oof", "--top", "3", "--folds", "3",
                 "--seeds", "2", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "trained" not in err and err.count("reused") >= 3 * 3  # every fold job and refit came from disk
    assert np.allclose(read_submission(out)[1], read_submission(oof_pick[0])[1], atol=1e-6)
    tight = world.root / "oof3" / "submission.csv"
    # a tiny budget with a fresh fold count (nothing to reuse) must shrink the plan and say so
    assert main(["pick", STUDY, "--state-dir", str(world.state), "--selection", "oof", "--top", "3", "--folds", "4",
                 "--seeds", "3", "--budget", "0.001", "--out", str(tight), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "budget 0 s" in err and "folds 4 -> 3" in err
    manifest = json.loads(tight.with_name("submission.manifest.json").read_text())
    assert manifest["notes"] and any("budget" in n for n in manifest["notes"])


@pytest.mark.slow
def test_default_budget_is_derived_from_the_study_printed_and_applied(world, oof_pick, capsys):
    from latentsweep.search.pick.plan import default_budget, study_wall_seconds

    out = world.root / "auto" / "submission.csv"
    assert main(["pick", STUDY, "--state-dir", str(world.state), "--top", "3", "--folds", "3", "--out", str(out),
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    study = optuna.load_study(study_name=STUDY, storage=world.storage)
    expected, _ = default_budget(study_wall_seconds(study.trials))
    assert f"budget: {expected:.0f} s (default: 0.5 x the study's" in err
    assert err.index("budget:") < err.index("plan:") < err.index("job 1/")  # said before any training
    manifest = json.loads(out.with_name("submission.manifest.json").read_text())
    assert manifest["options"]["budget"] == pytest.approx(expected)
    assert main(["pick", STUDY, "--state-dir", str(world.state), "--budget", "soon", "--quiet"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("uri", ["postgresql://postgres@127.0.0.1:9/nowhere", "http://127.0.0.1:9"])
def test_pick_probes_its_tracking_store_before_any_training(world, uri, capsys):
    out = world.root / "unreachable" / "submission.csv"
    code = main(["pick", STUDY, "--state-dir", str(world.state), "--tracking-uri", uri, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "not reachable" in err and "job 1/" not in err and "plan:" not in err
    assert not out.parent.exists()


def test_top_trials_rank_pruned_trials_by_their_best_reported_value():
    study = optuna.create_study(direction="maximize")
    for values, state in (([0.2, 0.4], TrialState.COMPLETE), ([0.1, 0.5], TrialState.PRUNED),
                          ([0.3], TrialState.PRUNED), ([], TrialState.PRUNED)):
        trial = study.ask()
        for step, v in enumerate(values):
            trial.report(v, step)
        study.tell(trial, values[-1] if state == TrialState.COMPLETE else None, state=state)
    ranked = candidates.top_trials(study, 5)
    assert [t.number for t in ranked] == [1, 0, 2]  # 0.5 (pruned), 0.4 (complete), 0.3; no value: left out
    assert candidates.trial_value(ranked[0], maximize=True) == 0.5


def test_an_ensemble_gain_not_above_its_standard_error_is_not_used():
    from latentsweep.search.pick.oof import OofSelection

    def selection(gains):
        gains = np.array(gains)
        return OofSelection(np.array([0.5, 0.5]), 0, np.array([0.4, 0.39]), 0.4, 0.41, gains, gains + 0.4,
                            np.full(len(gains), 0.4))

    assert selection([0.015, 0.017, 0.014]).gain_is_real  # +0.0153, standard error 0.0009
    # +0.0033, std 0.0045, standard error 0.0026: above one standard error (the rule), though inside one std
    assert selection([0.003, -0.001, 0.008]).gain_is_real
    noise = selection([0.004, -0.004, 0.003])  # +0.0010, standard error 0.0025: noise
    assert not noise.gain_is_real and noise.gain_se == pytest.approx(np.std([0.004, -0.004, 0.003], ddof=1) / 3 ** 0.5)
    from latentsweep.search.pick.selection import submitted_weights

    weights, notes = submitted_weights(noise, ["trial-1", "trial-2"], "one-se")
    assert weights.tolist() == [1.0, 0.0] and "best single member, trial-1" in notes[0]  # the fallback, forced
    weights, notes = submitted_weights(noise, ["trial-1", "trial-2"], "never")
    assert weights.tolist() == [0.5, 0.5] and notes == []  # --fallback never: the ensemble however small its gain
    weights, notes = submitted_weights(selection([0.015, 0.017, 0.014]), ["trial-1", "trial-2"], "one-se")
    assert weights.tolist() == [0.5, 0.5] and notes == []  # a real gain keeps the ensemble
    assert not selection([-0.002, -0.001]).gain_is_real
