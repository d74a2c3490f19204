"""Local UI servers (MLflow UI, optuna-dashboard) started and stopped for `latentsweep ui` and the benchmarks."""
