"""Studies: study files, search spaces, Optuna storage, workers, the objective, the launcher and reports."""
