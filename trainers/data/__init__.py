"""The trainer's data: the train, test and answer sets, their files, splits, holdouts, demo and synthetic data."""
