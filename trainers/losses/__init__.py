"""The losses package: registers every loss (importing its modules) and exports the registry and the Criterion.

A loss is a registered `Loss` module (base.py) built from its `cfg.loss.<name>` section; the translation losses are
in core.py, the queue loss with its buffers in queue.py, its exact all-images limit in bank.py, the multi-label triplet
in multilabel.py; the shared tau is
temperature.py; criterion.py combines the active ones for the loop.
"""
from latentsweep.trainers.losses import (  # noqa: F401  (importing registers their losses into LOSSES)
    bank, core, multilabel, queue,
)
from latentsweep.trainers.losses.base import LOSSES, EpochContext, Loss, register_loss
from latentsweep.trainers.losses.criterion import Criterion, active_losses, batch_keys
from latentsweep.trainers.losses.temperature import Temperature

__all__ = ["LOSSES", "Criterion", "EpochContext", "Loss", "Temperature", "active_losses", "batch_keys",
           "register_loss"]
