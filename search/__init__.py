"""Studies: search spaces, Optuna storage and workers, MLflow tracking, the picker and the CLI."""
