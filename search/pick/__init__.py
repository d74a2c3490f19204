"""`latentsweep pick`: candidates, out-of-fold selection, refits, the ensemble and its outputs (submission, model)."""
