"""Hiding secrets: URL passwords in any text, and secret-named values, before they reach a log, a param or a tag."""
from __future__ import annotations

import re
from typing import Any


# scheme://[user]:password@host -> the password runs to the last '@' that is followed by a host (no '@', no '/'),
# so an unencoded '@' or '/' inside a password is still hidden.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<pw>\S*)@(?=[^@/\s]*(?:[/?#\s]|$))")
_SECRET_KEYS = {"password", "passwd", "secret", "token", "api_key", "apikey", "access_key", "secret_key", "private_key"}
_SECRET_SUFFIXES = tuple(f"_{k}" for k in _SECRET_KEYS - {"token"})  # db_password yes, n_token (a size) no


def redact_url(text: str) -> str:
    """`text` with every URL password replaced by *** (postgresql://u:pw@h/db -> postgresql://u:***@h/db).

    A string that is one URL is rendered by SQLAlchemy with its password hidden; text that embeds URLs (an error
    message, a log line), and a URL whose unencoded '@' SQLAlchemy would split inside the password, go through
    _URL_PASSWORD."""
    if "://" not in text:  # no URL, no password to hide (and no SQLAlchemy to import for a plain error line)
        return text
    from sqlalchemy.engine import (  # here: importing latentsweep.search.failures (and so this module) stays light
        make_url,
    )
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except (ArgumentError, ValueError):
        url = None
    if url is not None and "@" not in (url.host or ""):
        return url.render_as_string(hide_password=True) if url.password is not None else text
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:***@" if m["pw"] else m[0], text)


def redact_values(values: dict[str, Any]) -> dict[str, Any]:
    """Copy of `values` with URL passwords hidden in string values and secret-named keys (password, db_password,
    token, …) masked."""
    out = {}
    for key, value in values.items():
        leaf = re.split(r"[./]", str(key))[-1].lower()
        if (leaf in _SECRET_KEYS or leaf.endswith(_SECRET_SUFFIXES)) and value not in (None, ""):
            out[key] = "***"
        else:
            out[key] = redact_url(value) if isinstance(value, str) else value
    return out
