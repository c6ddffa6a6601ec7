"""Reading one TOML table of the study file: typed look-ups whose errors name the file and key.

Used by every party while it reads the study file (`config_read.parse_study`,
`config_policy.read_policy`). A `TomlTable` records which keys were read, so
`finish` can refuse the unknown ones: a misspelt security setting must not be
silently ignored.

Why not a schema library (jsonschema, pydantic): the study file is read on a
base install (``keys``, ``site check``), whose dependencies are numpy, scipy
and cryptography only; jsonschema would add five packages (one compiled:
rpds-py) and ~55-65 ms of import (``python -X importtime``, jsonschema 4.26,
three runs) to every command, while reading and validating a whole study
file here takes ~0.55 ms. And its errors name JSON paths and validator
keywords; these name the file, the TOML key, the problem and, for an unknown
key, the keys that are known there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from .config_schema import NAME_RULE, is_valid_name

__all__ = ["REQUIRED", "TomlTable", "array_of_tables"]

#: The default of a key that must be given.
REQUIRED = object()


class TomlTable:
    """One TOML table being read: typed look-ups that name the file and key on error."""

    def __init__(self, data: Any, where: str, origin: str, base: Path) -> None:
        self.where = where
        self.origin = origin
        self.base = base
        if not isinstance(data, Mapping):
            raise self.error(f"must be a table, got {_kind(data)}", key=None)
        self.data = data
        self.used: set[str] = set()

    def error(self, problem: str, key: str | None) -> ConfigError:
        """The `ConfigError` for `problem` at `key` of this table (the table itself if None)."""
        path = self.where if key is None else (f"{self.where}.{key}" if self.where else key)
        return ConfigError(f"{self.origin}: {path or 'top level'}: {problem}")

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The value of `key` as TOML gave it (`default` if absent); marks the key as known."""
        self.used.add(key)
        if key in self.data:
            return self.data[key]
        if default is REQUIRED:
            raise self.error("is missing", key)
        return default

    def has(self, key: str) -> bool:
        """True if the optional `key` is given; marks it as known."""
        self.used.add(key)
        return key in self.data

    def string(self, key: str, default: Any = REQUIRED) -> str:
        """A string."""
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.error(f"must be a string, got {_kind(value)}", key)
        return value

    def name(self, key: str, default: Any = REQUIRED) -> str:
        """A party name, study id or array name (`NAME_RULE`)."""
        value = self.string(key, default)
        if not is_valid_name(value):
            raise self.error(f"{value!r} is not a valid name ({NAME_RULE})", key)
        return value

    def integer(self, key: str, default: Any, lo: int, hi: int | None = None) -> int:
        """An integer in ``[lo, hi]`` (no upper bound if `hi` is None); never a boolean."""
        value = self.raw(key, default)
        # bool is an int subclass in Python; `true` is not a number in a study file.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"must be an integer, got {_kind(value)}", key)
        if value < lo or (hi is not None and value > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise self.error(f"must be {bound}, got {value}", key)
        return value

    def boolean(self, key: str, default: Any = REQUIRED) -> bool:
        """``true`` or ``false``."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(f"must be true or false, got {_kind(value)}", key)
        return value

    def choice(self, key: str, default: Any, choices: Sequence[str]) -> str:
        """One of the strings `choices`."""
        value = self.string(key, default)
        if value not in choices:
            raise self.error(f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}", key)
        return value

    def names(self, key: str, what: str, known: Sequence[str] | None = None, *, single: bool = False) -> tuple[str, ...]:
        """An array of names (or, with `single`, also one name); each in `known` if given; no repeats."""
        value = self.raw(key)
        if single and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"must be an array of {what} names, got {_kind(value)}", key)
        for v in value:
            if not is_valid_name(v):
                raise self.error(f"{what} name {v!r} is not a valid name ({NAME_RULE})", key)
            if known is not None and v not in known:
                raise self.error(f"unknown {what} {v!r} (known: {', '.join(sorted(known))})", key)
        if len(set(value)) != len(value):
            raise self.error(f"lists a {what} twice", key)
        return tuple(value)

    def number(self, key: str, default: Any) -> float:
        """A finite number > 0, as a float."""
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"must be a number, got {_kind(value)}", key)
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise self.error(f"must be a finite number > 0, got {value}", key)
        return value

    def path(self, key: str, default: Any = REQUIRED) -> Path:
        """A path (``~`` expanded), made absolute against the folder of the study file."""
        value = self.string(key, default)
        if not value.strip():
            raise self.error("must be a non-empty path", key)
        if "\x00" in value:
            raise self.error("must not contain NUL characters", key)
        return _resolve(self.base, value)

    def table(self, key: str) -> TomlTable:
        """The sub-table `key`."""
        return TomlTable(self.raw(key), f"{self.where}.{key}" if self.where else key, self.origin, self.base)

    def finish(self, known: Sequence[str] = ()) -> None:
        """Refuse any key of this table that was never read, naming the keys it takes: `known` (a table whose
        optional keys are read only when present) and those read."""
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used | set(known)))
            raise self.error(f"unknown key {unknown[0]!r} (known keys here: {known})", key=None)


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    # normpath, not resolve(): keep symlinks as written, just make the path absolute.
    return Path(os.path.normpath(p if p.is_absolute() else base / p))


def array_of_tables(top: TomlTable, key: str) -> list[TomlTable]:
    """The ``[[key]]`` tables of `top` (none if the key is absent)."""
    value = top.raw(key, [])
    if not isinstance(value, list):
        raise top.error(f"must be an array of tables ([[{key}]]), got {_kind(value)}", key)
    return [TomlTable(item, f"{key}[{i}]", top.origin, top.base) for i, item in enumerate(value)]

