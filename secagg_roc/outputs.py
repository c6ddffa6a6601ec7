"""Where a command writes its results: an output folder checked before any work starts.

Run by the CLI (``demo``, ``analyze``) and by `report.write_report`, so that a
bad ``--out`` (an existing file, a folder that cannot be made, one that is not
writable) is one line naming the option before a minute of analysis, never a
traceback after it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

__all__ = ["output_folder"]


def output_folder(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """`path` as a writable folder (made if missing); `ConfigError` naming `option` when it cannot be."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{option} {folder}: is a file, not a folder; name a folder (it is made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {folder}: cannot make this folder: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {folder}: this folder is not writable by this user")
    return folder
