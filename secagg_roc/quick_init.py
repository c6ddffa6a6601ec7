"""`quick_init`: a frozen dataclass's `__init__` without `object.__setattr__` per field.

Run by every party: a round makes ~100 small frozen objects per task of the
embedded study (each share a site sends, each share's payloads, the
aggregators' acknowledgements and statuses, each query result). The
`__init__` that `dataclasses` writes for a frozen class sets every field
through ``object.__setattr__`` (a global lookup, an attribute lookup and a
call per field); a 9-field share took ~1.2 us, ~0.5 us with the fields
stored in the instance's `__dict__` directly, which is what
``object.__setattr__`` does for a class without slots (a frozen dataclass
cannot have a `__setattr__` of its own).

The replacement takes the same arguments (names, order, defaults, default
factories, keyword-only fields), sets the same fields (those with
``init=False`` from their default or factory) and calls `__post_init__`
after them, as the generated one does; instances compare, hash, print,
`replace` and pickle as before (those read the fields, not how they were set).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

__all__ = ["quick_init"]

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Give frozen dataclass `cls` an `__init__` that stores its fields in the instance `__dict__` directly.

    Apply it above ``@dataclass(frozen=True)``. Refuses (TypeError) a class it cannot serve exactly: not a
    frozen dataclass, one with slots, or one with `InitVar` pseudo-fields."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass")
    if "__slots__" in cls.__dict__ or any("__slots__" in vars(base) for base in cls.__mro__[1:-1]):
        raise TypeError(f"quick_init: {cls.__name__} has slots (no instance __dict__ to fill)")
    fields = dataclasses.fields(cls)
    names: dict[str, Any] = {"_MISSING": dataclasses.MISSING}
    args: list[str] = []
    kw_only: list[str] = []
    body: list[str] = ["  d = self.__dict__"]
    for f in fields:
        default_name, factory_name = f"_dflt_{f.name}", f"_fact_{f.name}"
        if f.init:
            if f.default is not dataclasses.MISSING:
                names[default_name] = f.default
                arg = f"{f.name}={default_name}"
            elif f.default_factory is not dataclasses.MISSING:
                names[factory_name] = f.default_factory
                arg = f"{f.name}=_MISSING"
                body.append(f"  if {f.name} is _MISSING: {f.name} = {factory_name}()")
            else:
                arg = f.name
            (kw_only if f.kw_only else args).append(arg)
            body.append(f"  d[{f.name!r}] = {f.name}")
        elif f.default is not dataclasses.MISSING:
            names[default_name] = f.default
            body.append(f"  d[{f.name!r}] = {default_name}")
        elif f.default_factory is not dataclasses.MISSING:
            names[factory_name] = f.default_factory
            body.append(f"  d[{f.name!r}] = {factory_name}()")
    if hasattr(cls, "__post_init__"):
        body.append("  self.__post_init__()")
    signature = ", ".join(["self", *args, *(["*", *kw_only] if kw_only else [])])
    source = f"def __init__({signature}):\n" + "\n".join(body) + "\n"
    exec(compile(source, f"<quick_init {cls.__qualname__}>", "exec"), names)  # noqa: S102 - our own text
    init = names["__init__"]
    # The same parameters as the generated `__init__` (an InitVar, say, would be missing here): else refused.
    if list(inspect.signature(init).parameters) != list(inspect.signature(cls.__init__).parameters):
        raise TypeError(f"quick_init: {cls.__name__}'s __init__ takes arguments quick_init does not model")
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc]
    return cls
