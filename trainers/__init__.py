"""The common trainer: data, splits, models, losses, metrics and the training loop (no optuna, no mlflow)."""
if __name__ != "latentsweep.trainers":  # imported by its folder's name from a checkout: a second, unrelated copy
    raise ImportError("latentsweep's code imports under one name: use `latentsweep.trainers`, not `trainers`")
