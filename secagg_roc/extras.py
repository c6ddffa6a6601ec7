"""Optional extras: which commands need which, and the one-line message when one is missing.

A base install (``pip install secagg-roc``: numpy, scipy, cryptography) runs
the library, the embedded demo, ``keys`` and ``site check``. The network
parties need ``[deploy]`` (aiohttp for the aggregator's HTTPS service, tqdm
for the analyst's progress, tomli-w to write study files); plots need ``[plot]`` (matplotlib); ``simulate --workers/--scheduler``
needs ``[dask]`` (dask.distributed). The CLI
checks the extra of a command before it imports anything of it, so a missing
extra is one line naming the ``pip install`` to run, never a traceback.
"""

from __future__ import annotations

import importlib

__all__ = ["EXTRAS", "MissingExtra", "missing", "require"]

#: The modules each extra of ``pyproject.toml`` installs, by extra.
EXTRAS: dict[str, tuple[str, ...]] = {
    "deploy": ("aiohttp", "tqdm", "tomli_w"),
    "plot": ("matplotlib",),
    "dask": ("dask", "distributed"),
}


class MissingExtra(ImportError):
    """A command needs an optional extra that is not installed; the text says what to install."""


def missing(extra: str) -> str | None:
    """The first module of `extra` that cannot be imported, or None when the extra is installed."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            return module
    return None


def require(extra: str, what: str) -> None:
    """Raise `MissingExtra` naming `what` needs and the ``pip install`` that brings it."""
    module = missing(extra)
    if module is not None:
        raise MissingExtra(f"{what} needs the [{extra}] extra ({module} is not installed): "
                           f"pip install 'secagg-roc[{extra}]'")
