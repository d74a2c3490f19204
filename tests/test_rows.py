"""Training holds no copies of the data: Rows gathers per batch, column statistics are bit-identical, fits are lazy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.models.zoo import ModelContext, build_model
from latentsweep.trainers.train.regularise import BatchAugment
from latentsweep.trainers.data.rows import STAT_COLUMNS, Rows, column_stat
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import TASKS

SMALL = {"model.hidden": "32", "train.batch_size": 32, "data.val_ratio": 0.2, "train.seed": 0, "train.device": "cpu",
         "data.center_text": True}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path, _, _ = write_synthetic(tmp_path_factory.mktemp("rows"), 120, dim_text=300, dim_image=20)
    return load_train(path)


def subset(n_base: int, n: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n_base, width, generator=gen) * 3 + 1  # off-centre, so the mean is not ~0
    index = torch.randperm(n_base, generator=gen)[:n]
    return base, index


def test_rows_gather_what_the_copy_holds():
    base, index = subset(50, 30, 7)
    rows, copy = Rows(base, index), base[index]
    assert len(rows) == 30 and rows.shape == copy.shape and rows.dtype == copy.dtype
    assert torch.equal(rows[3:11], copy[3:11])
    pick = torch.tensor([5, 0, 29, 5])
    assert torch.equal(rows[pick], copy[pick])
    assert torch.equal(rows.materialize(), copy)


@pytest.mark.parametrize("n, width", [(5000, 3 * STAT_COLUMNS + 17), (40, STAT_COLUMNS - 1), (2, 2 * STAT_COLUMNS)])
def test_column_stats_are_bit_identical_to_the_copy(n, width):
    """Mean and std per column, one block of columns at a time, equal the whole copy's to the last bit (the text
    centring and the noise scale: any difference would change training)."""
    base, index = subset(n + 10, n, width)
    rows, copy = Rows(base, index), base[index]
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(rows.column_stat(lambda x: x.mean(0)), copy.mean(0))
            assert torch.equal(column_stat(rows, lambda x: x.float().std(dim=0)), copy.float().std(dim=0))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(column_stat(copy, lambda x: x.mean(0)), copy.mean(0))  # a plain tensor: the stat itself


def test_translate_task_reads_the_loaded_captions_in_place(data):
    """The task's training captions are the loaded array's memory plus an index: no [N, Dt] copy."""
    task = TASKS.get("translate")(with_values(Config(), SMALL), data, torch.device("cpu"))
    assert isinstance(task.x, Rows)
    assert np.shares_memory(task.x.base.numpy(), data.text)
    batch = next(task.batches(torch.Generator().manual_seed(0)))
    assert batch["x"].shape == (32, data.text.shape[1])
    # every batch row is a training caption of its image: the gathered text is the loaded row of that caption
    rows = task.x.index.numpy()
    assert np.isin(batch["x"].numpy(), data.text[rows]).all()
    assert torch.equal(task.text_mean, torch.as_tensor(data.text[rows]).mean(0))


def test_fit_pairs_are_built_only_for_the_models_that_read_them(data):
    task = TASKS.get("translate")(with_values(Config(), SMALL), data, torch.device("cpu"))
    calls = []

    def counted():
        calls.append(1)
        return task._fit_set()

    build_model(with_values(Config(), {**SMALL, "model.kind": "mlp"}), ModelContext(task.dim_in, task.dim_out,
                                                                                    fit=counted))
    assert calls == []  # an MLP never reads them
    ctx = ModelContext(task.dim_in, task.dim_out, fit=counted, device=torch.device("cpu"))
    build_model(with_values(Config(), {**SMALL, "model.kind": "geometry"}), ctx)
    assert calls == [1]
    fit_x, fit_y = ctx.fit_x, ctx.fit_y
    assert calls == [1]  # built once, then kept by the context
    rows = task.x.index.numpy()
    assert torch.equal(fit_x, torch.as_tensor(data.text[rows]) - task.text_mean)
    assert torch.equal(fit_y, task.images[task.img])


def test_noise_scale_from_rows_equals_the_copy(data):
    cfg = with_values(Config(), {**SMALL, "augment.noise_std": 0.1})
    task = TASKS.get("translate")(cfg, data, torch.device("cpu"))
    from_rows = BatchAugment(cfg, task.x).sigma
    assert torch.equal(from_rows, BatchAugment(cfg, task.x.materialize()).sigma)


def test_targets_are_normalised_per_batch_unless_the_all_images_loss_reads_them_all(data):
    """Without the all-images bank the task holds no normalised copy of the training images; each batch's y_n equals
    the rows of the whole normalised matrix to the last bit (so training is unchanged). With the bank it is held."""
    task = TASKS.get("translate")(with_values(Config(), SMALL), data, torch.device("cpu"))
    assert task.images_n is None
    whole = torch.nn.functional.normalize(task.images.materialize(), dim=1)
    for batch in list(task.batches(torch.Generator().manual_seed(1)))[:3]:
        assert torch.equal(batch["y_n"], whole[batch["img"]])
    banked = TASKS.get("translate")(with_values(Config(), {**SMALL, "loss.all_images_infonce.weight": 1.0}), data,
                                    torch.device("cpu"))
    assert banked.bank and torch.equal(banked.images_n, whole)


def test_validation_ranks_predictions_block_by_block(tmp_path):
    """evaluate() asks the model for one metrics block of val captions at a time (never all of them at once) and
    gets the same metrics as ranking the held predictions."""
    from latentsweep.trainers.eval import metrics
    from latentsweep.trainers.train.tasks import predict

    path, _, _ = write_synthetic(tmp_path, 600, dim_text=30, dim_image=20)
    task = TASKS.get("translate")(with_values(Config(), SMALL), load_train(path), torch.device("cpu"))
    model = build_model(with_values(Config(), SMALL), task.model_context())
    sizes = []
    model.register_forward_hook(lambda module, args, out: sizes.append(len(args[0])))
    got = task.evaluate(model)
    assert len(task.val_x) > 2 * metrics.DEFAULT_CHUNK  # several blocks
    assert max(sizes) == metrics.DEFAULT_CHUNK and sum(sizes) == len(task.val_x)
    held = metrics.evaluate(predict(model, task.val_x.materialize()), task.val_images, task.val_img)
    assert got == {f"val/{k}": v for k, v in held.items()}
