"""Where a run came from: MLflow's source tags (source name and type, git commit, user)."""
from __future__ import annotations

import functools
import getpass
import subprocess
from pathlib import Path

# MLflow's own tag names (mlflow/utils/mlflow_tags.py), so its UI fills the Source and User fields.
GIT_COMMIT_TAG = "mlflow.source.git.commit"
SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"
USER_TAG = "mlflow.user"


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the latentsweep checkout, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_tags(name: str) -> dict[str, str]:
    """MLflow's source tags (Source and User columns of its UI): source name and type, git commit, user."""
    tags = {SOURCE_NAME_TAG: name, SOURCE_TYPE_TAG: "LOCAL"}
    commit = git_commit()
    if commit:
        tags[GIT_COMMIT_TAG] = commit
    try:
        tags[USER_TAG] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        pass
    return tags
