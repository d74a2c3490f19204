"""The trainer's evaluation: the one metrics module and submission files."""
