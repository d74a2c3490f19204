"""Training throughput of the VSE++ MLP at batch 512 against this machine's matmul FLOP rate and a DataLoader loop.

Prints, from one run: (1) the machine's float32 matmul rate (GFLOP/s), (2) the trainer's samples/s and the FLOP rate
it reaches (forward + backward = 3x the forward matmul FLOPs of the MLP), as a fraction of (1) (goal >= 0.80 on CPU),
(3) a plain `DataLoader(TensorDataset)` loop with the same model, loss and optimiser (goal: trainer not slower on CPU,
>= 3x faster on a CUDA GPU), (4) the per-epoch evaluation cost (both protocols) as a fraction of a training epoch at
challenge scale (goal <= 10%). "The trainer" is the real one: the translate task's batches, the CenteredModel wrapper,
the configured optimiser (fused Adam) and the loop's per-epoch body. Each ratio pairs a matmul-rate measurement with
the epoch right after it (`--repeats` pairs; median and range printed). `--profile` prints the top operators.

The FLOP count leaves out the loss's own [B, B] similarity matmul (1/7 of the MLP's FLOPs at these sizes) and the
optimiser, so a ratio of 1.0 is out of reach by construction; the rest is elementwise work (normalisation, GELU,
the hinge, the fused Adam step over 5.3M parameters) and the batch gathers.

    python benchmarks/throughput.py [--device cuda] [--steps 30] [--repeats 3] [--profile]
    python benchmarks/throughput.py --smoke      # the same code path at toy sizes, in seconds (tests)
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from latentsweep.trainers.eval import metrics  # noqa: E402
from latentsweep.trainers.train.capture import CAPTURES, StepForward  # noqa: E402
from latentsweep.trainers.train.checkpoint import CenteredModel  # noqa: E402
from latentsweep.trainers.config.tree import Config, with_values  # noqa: E402
from latentsweep.trainers.data.sets import TrainSet  # noqa: E402
from latentsweep.trainers.train.loop import StepParts, _train_epoch  # noqa: E402
from latentsweep.trainers.train.regularise import BatchAugment, build_average  # noqa: E402
from latentsweep.trainers.losses import Criterion  # noqa: E402
from latentsweep.trainers.models.zoo import ModelContext, build_model  # noqa: E402
from latentsweep.trainers.train.optim import build_optimizer  # noqa: E402
from latentsweep.trainers.train.tasks import TASKS  # noqa: E402

CAPS_PER_IMAGE = 5
VAL_RATIO = 0.01  # the smallest split the config allows: the benchmark times training, not validation


@dataclass(frozen=True)
class Dims:
    """The sizes measured: the MLP's widths, the batch, and the validation / training scale of the eval cost."""
    text: int
    image: int
    hidden: int
    batch: int
    val_images: int
    train_captions: int
    matmul: int = 2048  # side of the square matmul whose rate is the machine's ceiling

    def flops_per_sample(self) -> int:
        """Forward matmul FLOPs of the MLP per sample, x3 for forward + backward."""
        return 3 * 2 * (self.text * self.hidden + self.hidden * self.image)


# Challenge dims (RoBERTa 1024 -> DINOv2 1536), the VSE++ recipe's hidden width, and the challenge validation scale
# (10% of 25,000 images x 5 captions)
CHALLENGE = Dims(1024, 1536, 2048, 512, 2500, 112_500)
SMOKE = Dims(32, 48, 64, 32, 40, 1000, matmul=128)  # --smoke: every code path, in seconds


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


def vsepp_cfg(dims: Dims, capture: str = "none") -> Config:
    """The VSE++ MLP recipe at `dims`; `capture` is train.capture (the trainer's step eager or compiled)."""
    return with_values(Config(), {"model.hidden": str(dims.hidden), "loss.triplet.weight": 1.0, "optim.name": "adam",
                                  "train.batch_size": dims.batch, "data.val_ratio": VAL_RATIO,
                                  "train.capture": capture})


def random_trainset(n_captions: int, dims: Dims) -> TrainSet:
    """Random data at `dims` with CAPS_PER_IMAGE captions per image (content does not matter for speed)."""
    n_images = -(-n_captions // CAPS_PER_IMAGE)
    gen = np.random.default_rng(0)
    cap2img = np.arange(n_images).repeat(CAPS_PER_IMAGE)
    return TrainSet(path="random", fingerprint="random", caption_ids=np.arange(len(cap2img)),
                    caption_text=np.array([""] * len(cap2img)),
                    text=gen.standard_normal((len(cap2img), dims.text), dtype=np.float32),
                    image=gen.standard_normal((n_images, dims.image), dtype=np.float32), cap2img=cap2img,
                    image_names=np.array([f"img{i}" for i in range(n_images)]))


class TrainerEpoch:
    """The trainer itself: the translate task's batches, the CenteredModel wrapper, the configured optimiser and
    schedule, and the loop's own per-epoch body (`latentsweep.trainers.train.loop._train_epoch`), at challenge dims."""

    def __init__(self, device: torch.device, steps: int, dims: Dims = CHALLENGE, capture: str = "none"):
        # train captions = (1 - val_ratio) of the data; the hash split is only approximately that, so pad by 20%
        # (and at least 1,000 captions: val_ratio=0.01 of fewer images may leave the validation side empty)
        n = max(int(dims.batch * steps / (1 - VAL_RATIO) * 1.2), 1000)
        cfg = vsepp_cfg(dims, capture)
        task = TASKS.get("translate")(cfg, random_trainset(n, dims), device)
        model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean).to(device)
        criterion = Criterion(cfg, task.dim_out).to(device)
        self.steps = task.steps_per_epoch()
        opt, schedule = build_optimizer(cfg, model, criterion, self.steps)
        amp = cfg.train.amp and device.type == "cuda"
        # the same parts `latentsweep.trainers.train.loop._fit` builds for a run
        self.parts = StepParts(cfg, task, model, criterion, opt, schedule,
                               torch.amp.GradScaler(device.type, enabled=amp), torch.Generator().manual_seed(0),
                               self.steps, amp, BatchAugment(cfg, task.x), build_average(cfg, model),
                               forward=StepForward(cfg, model, criterion, amp, device))
        self.device, self.batch = device, dims.batch

    def run(self) -> float:
        """Samples/s of one training epoch (no evaluation)."""
        sync(self.device)
        start = time.perf_counter()
        _train_epoch(self.parts, 0)
        sync(self.device)
        return self.batch * self.steps / (time.perf_counter() - start)


def dataloader_loop(device: torch.device, steps: int, dims: Dims = CHALLENGE) -> float:
    """The common notebook way: DataLoader(TensorDataset) on CPU tensors, a host-to-device copy per batch, the same
    model, loss and optimiser as the trainer."""
    cfg = vsepp_cfg(dims)
    model = build_model(cfg, ModelContext(dims.text, dims.image)).to(device)
    criterion = Criterion(cfg, dims.image).to(device)
    opt, _ = build_optimizer(cfg, model, criterion, steps)
    x = torch.randn(dims.batch * steps, dims.text)
    y = torch.nn.functional.normalize(torch.randn(dims.batch * steps, dims.image), dim=1)
    loader = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=dims.batch, shuffle=True)

    def step(xb, yb, ib):
        loss, _ = criterion(model(xb), {"x": xb, "y": yb, "y_n": yb, "img": ib})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    batches = iter(loader)
    step(*(t.to(device) for t in next(batches)))  # warm-up
    sync(device)
    start, n = time.perf_counter(), 0
    for xb, yb, ib in batches:
        step(xb.to(device), yb.to(device), ib.to(device))
        n += len(xb)
    sync(device)
    return n / (time.perf_counter() - start)


def eval_cost(device: torch.device, train_rate: float, dims: Dims = CHALLENGE) -> tuple[float, float]:
    """Seconds of one per-epoch evaluation at `dims`' scale and its fraction of one training epoch."""
    cfg = vsepp_cfg(dims)
    model = build_model(cfg, ModelContext(dims.text, dims.image)).to(device)
    val_x = torch.randn(dims.val_images * CAPS_PER_IMAGE, dims.text, device=device)
    images = torch.randn(dims.val_images, dims.image, device=device)
    cap2img = torch.arange(dims.val_images).repeat_interleave(CAPS_PER_IMAGE).numpy()
    start = time.perf_counter()
    with torch.no_grad():
        model.eval()
        pred = torch.cat([model(val_x[i : i + 4096])["pred"] for i in range(0, len(val_x), 4096)])
    metrics.evaluate(pred, images, cap2img)
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, seconds / (dims.train_captions / train_rate)


def profile(device: torch.device, steps: int, dims: Dims = CHALLENGE, capture: str = "none") -> None:
    """Where a training epoch's time goes: the top operators by self time (matmuls vs the rest)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    epoch = TrainerEpoch(device, steps, dims, capture)
    epoch.run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        epoch.run()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved matmul-rate / trainer measurements")
    parser.add_argument("--profile", action="store_true", help="print the top operators of one epoch and exit")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, 3 steps, 1 repeat: the code path in seconds")
    parser.add_argument("--capture", choices=CAPTURES, default="none",
                        help="train.capture of the trainer's step (compile: the first repeat includes the compile)")
    args = parser.parse_args(argv)
    dims = SMOKE if args.smoke else CHALLENGE
    if args.smoke:
        args.steps, args.repeats = 3, 1
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(device, args.steps, dims, args.capture)
        return 0
    for line in measure(device, args.steps, args.repeats, dims, args.capture):
        print(line)
    return 0


def measure(device: torch.device, steps: int, repeats: int, dims: Dims = CHALLENGE,
            capture: str = "none") -> list[str]:
    """The report's lines: matmul rate, the trainer's rate and its fraction of it, the DataLoader loop, eval cost."""
    epoch = TrainerEpoch(device, 2, dims, capture)
    epoch.run()  # warm-up (allocator, kernels, fused-optimiser state)
    epoch = TrainerEpoch(device, steps, dims, capture)
    # Each ratio pairs a matmul-rate measurement with the epoch right after it: on a shared machine the load drifts,
    # and a ratio of two measurements taken minutes apart would mostly measure that drift.
    peaks, rates, ratios = [], [], []
    for _ in range(repeats):
        peaks.append(matmul_rate(device, dims.matmul))
        rates.append(epoch.run())
        ratios.append(rates[-1] * dims.flops_per_sample() / 1e9 / peaks[-1])
    theirs = dataloader_loop(device, steps, dims)
    ours = max(rates)
    seconds, frac = eval_cost(device, ours, dims)
    mid = sorted(ratios)[len(ratios) // 2]
    n_val = dims.val_images * CAPS_PER_IMAGE
    return [
        f"device {device}, torch threads {torch.get_num_threads()}, batch {dims.batch}, "
        f"MLP {dims.text}-{dims.hidden}-{dims.image}, step {epoch.parts.forward.path} (train.capture)",
        f"matmul rate                  : {max(peaks):8.1f} GFLOP/s (range {min(peaks):.1f}-{max(peaks):.1f})",
        f"trainer                      : {ours:8.0f} samples/s = {ours * dims.flops_per_sample() / 1e9:7.1f} GFLOP/s; "
        f"median {mid:.2f} of the matmul rate (range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} "
        f"interleaved pairs; goal >= 0.80 on CPU)",
        f"DataLoader(TensorDataset)    : {theirs:8.0f} samples/s; trainer / DataLoader = {ours / theirs:.2f} "
        f"(goal >= 1.0 on CPU, >= 3.0 on CUDA)",
        f"evaluation ({n_val:,} x {dims.val_images:,})  : {seconds:8.2f} s = {frac:.3f} of a "
        f"{dims.train_captions}-caption training epoch (goal <= 0.10)",
    ]


if __name__ == "__main__":
    sys.exit(main())
