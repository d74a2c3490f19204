"""Checkpoints: the CenteredModel wrapper (text centring + model), atomic save, and safe (weights_only) load."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from latentsweep.trainers.config.tree import Config, from_dict, to_dict, upgrade_tree
from latentsweep.trainers.core import pages
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.models.zoo import ModelContext, build_model

FORMAT_VERSION = 1


class CenteredModel(nn.Module):
    """What is trained and saved: subtract the train text mean (zeros when centring is off), then the model."""

    def __init__(self, inner: nn.Module, text_mean: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("text_mean", text_mean.detach().clone().float())

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner(x - self.text_mean)

    def param_groups(self):
        if hasattr(self.inner, "param_groups"):
            return self.inner.param_groups()
        return [("main", list(self.inner.parameters()), 1.0)]

    def on_epoch_start(self, epoch: int) -> None:
        if hasattr(self.inner, "on_epoch_start"):
            self.inner.on_epoch_start(epoch)

    def on_epoch_end(self, epoch: int, val_metric: float) -> None:
        if hasattr(self.inner, "on_epoch_end"):
            self.inner.on_epoch_end(epoch, val_metric)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save through latentsweep.trainers.core.io.atomic_write: a crash never leaves a half-written checkpoint;
    and through pages.Writer: a knn model's training arrays, rows of the sealed train set, are written a block at a
    time with their pages handed back after each, instead of mapped whole (0.5 GB at challenge size)."""
    with atomic_write(path, "wb") as fh, _without_crc32():
        torch.save(obj, pages.Writer(fh))


@contextlib.contextmanager
def _without_crc32():
    """torch.save with no CRC-32 of its records, put back after. Why: the CRC pass reads a whole tensor before
    writing it, which maps all of a knn model's training arrays at once (what pages.Writer avoids). Nothing is lost:
    `_read` maps the file, which checks no CRC; atomic_write rules out a half-written file; torch.load reads such a
    file whole too (torch.serialization.set_crc32_options). The lock: the setting is global to the process."""
    with _CRC32_LOCK:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)


_CRC32_LOCK = threading.Lock()


def checkpoint_payload(model: CenteredModel | dict, cfg: Config, dims: tuple[int, int], meta: dict,
                       loss_state: dict[str, torch.Tensor] | None = None) -> dict:
    """Plain types and tensors only, so that torch.load(weights_only=True) can read it back. `model` may be given as
    its state dict (the training loop's copy of its best epoch). `loss_state` is the
    criterion's `state_dict()` (the learned logit scale; the queue is a non-persistent buffer and is not in it):
    `Criterion.load_state_dict(payload["loss_state"])` restores it, renaming the earlier format's key."""
    state = model if isinstance(model, dict) else model.state_dict()
    return {
        "format": FORMAT_VERSION,
        "config": to_dict(cfg),
        "dim_in": int(dims[0]),
        "dim_out": int(dims[1]),
        "state_dict": {k: v.detach().cpu() for k, v in state.items()},
        "loss_state": {k: v.detach().cpu() for k, v in (loss_state or {}).items()},
        "meta": meta,
    }


def _read(path: Path) -> dict:
    """The checkpoint's payload, its tensors mapped from the file (torch.load mmap: pages read as touched and shared
    with the page cache, not a private copy to copy again into the model: a knn model keeps them as its keys, 0.5 GB
    at challenge size), or read whole from a file torch cannot map (the legacy format)."""
    try:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not the zip format that mmap needs: read it whole
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LatentsweepError(f"{path}: checkpoint not found") from None
    except Exception as exc:  # unpickling errors have many types; the message is what the user needs
        raise LatentsweepError(f"{path}: not a readable latentsweep checkpoint ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise LatentsweepError(f"{path}: not a latentsweep checkpoint (format {FORMAT_VERSION} expected)")
    return payload


def checkpoint_dims(path: str | Path) -> tuple[int, int]:
    """(dim_in, dim_out) of the model a checkpoint holds, as saved, without running it: a probe row made a knn model
    read every key (0.5 GB of the mapped file at challenge size, resident from then on)."""
    payload = _read(Path(path))
    return int(payload["dim_in"]), int(payload["dim_out"])


def load_model(path: str | Path, device: str | torch.device = "cpu",
               rng_free: bool = False) -> tuple[CenteredModel, Config, dict]:
    """Rebuild the model from a checkpoint (no closed-form refit: weights come from the state dict). `rng_free`:
    built on the meta device and given the checkpoint's tensors, so that nothing draws from torch's global generator
    (a load beside a running trial, latentsweep.search.pick.safe); buffers the checkpoint does not hold are zeros."""
    path = Path(path)
    payload = _read(path)
    try:
        cfg = from_dict(upgrade_tree(payload["config"]), where=str(path))
        ctx = ModelContext(int(payload["dim_in"]), int(payload["dim_out"]), fit_x=None, fit_y=None)
        with torch.device("meta") if rng_free else contextlib.nullcontext():
            model = CenteredModel(build_model(cfg, ctx), torch.zeros(ctx.dim_in))
        model.load_state_dict(payload["state_dict"], assign=rng_free)
        for module in model.modules() if rng_free else ():  # non-persistent buffers (training-only state)
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)
    except LatentsweepError as exc:
        raise LatentsweepError(f"{path}: checkpoint config is invalid: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a missing key, a wrong shape or type: the file does not fit its config
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise LatentsweepError(f"{path}: checkpoint does not match its config ({type(exc).__name__}: {reason})") \
            from None
    meta = payload.get("meta", {})
    return model.to(device).eval(), cfg, meta if isinstance(meta, dict) else {}
