"""User-facing error types: anything raised as these is printed as one line by the CLI (exit code 2)."""
import difflib


class LatentsweepError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class DataError(LatentsweepError):
    """A data file is missing, malformed or inconsistent (message names the file, key and row)."""


class ConfigError(LatentsweepError):
    """A config, study file or override is invalid (message names the key and the closest valid one)."""


def closest(name: str, options) -> str:
    """Return ' (did you mean X?)' for the closest option, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""
