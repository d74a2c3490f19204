"""Studies: search spaces, Optuna storage and workers, MLflow tracking, the picker, the CLI and the Python API."""
if __name__ != "latentsweep.search":  # imported by its folder's name from a checkout: a second, unrelated copy
    raise ImportError("latentsweep's code imports under one name: use `import latentsweep as ls` (the API) or "
                      "`latentsweep.search`, not `search`")
