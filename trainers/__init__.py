"""The common trainer: data, splits, models, losses, metrics and the training loop (no optuna, no mlflow)."""
