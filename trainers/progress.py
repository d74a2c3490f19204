"""The trainer's one way to tell its user something (it never prints): a warning of the `latentsweep` logger, which
search's progress channel (search/progress.py) says on stderr, silences or redirects. `once` names a message every
run of a process would repeat (a study's trials share one), said once per sink."""
from __future__ import annotations

import logging

LOGGER = logging.getLogger("latentsweep")


def tell(line: str, once=None) -> None:
    LOGGER.warning(line, extra={"once": once} if once is not None else None)


__all__ = ["tell"]
