"""Run by each Site when a run starts: the checks of its data for the run's analysis (`data_problems`).

The arrays must suit their roles and hold enough records, no class of a label
may be a small group (`queries.groups`), no array may be a near copy of
another (`queries.copies`), the analysis adds its own checks (`Plan.data_check`,
such as the GLM's on covariates), and, after those, no array may be a near
combination of several others (`queries.combinations`).

Apart from the analysis's own checks, every verdict is a function of the
site's data (every array: names, dtypes, shapes, bytes), the (role, array)
pairs the analysis uses, and the policy's minimum cell count, roles and
allowed analyses (near copies are judged within classes where one of them
sums values over them). A site
passes its data's digest (the SHA-256 its ledger keys releases by, computed at
every join anyway), and the verdict is remembered under that digest and those
parameters: a site checks the same arrays at every run's join (a simulation's
126 settings of one data set, or a deployed site's many analyses), and the
checks' numpy calls on its arrays cost more than the digest. Nothing is
skipped: the same arrays give the same verdict, and other arrays another key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable

from ..policy import Policy
from ..queries import SiteData
from ..queries.checks import role_problems
from ..queries.combinations import near_combinations
from ..queries.copies import near_copies
from ..queries.groups import label_problems
from .base import Plan

__all__ = ["MAX_JOIN_VERDICTS", "data_problems"]

#: Verdicts kept (the oldest dropped beyond this): a few per site and analysis.
MAX_JOIN_VERDICTS = 1024

_VERDICTS: OrderedDict[tuple, tuple[str, ...]] = OrderedDict()
_LOCK = threading.Lock()


def _remembered(key: tuple | None, judge: Callable[[], list[str]]) -> list[str]:
    """`judge()`, remembered under `key` (None: computed, not kept)."""
    if key is None:
        return judge()
    with _LOCK:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return list(_VERDICTS[key])
    found = tuple(judge())
    with _LOCK:
        _VERDICTS[key] = found
        while len(_VERDICTS) > MAX_JOIN_VERDICTS:
            _VERDICTS.popitem(last=False)
    return list(found)


def data_problems(data: SiteData, plan: Plan, args: dict[str, Any], policy: Policy,
                  digest: str | None = None) -> list[str]:
    """What keeps `data` out of a run of `plan` with canonical `args` under `policy`; [] if nothing.

    Run by a Site at a run's join. `digest` (`SiteData.digest()` of `data`) lets the verdicts on the data be
    remembered; the analysis's own `data_check` is run every time."""
    roles = policy.roles
    uses = list(plan.uses(args))
    min_cell = policy.min_cell_count
    need = plan.min_records(policy)
    role_key = None if roles is None else tuple(sorted((r, tuple(a)) for r, a in roles.items()))
    # (The allowed analyses too: near copies are judged within classes where one of them sums values over them.)
    base = None if digest is None else (digest, tuple(uses), min_cell, role_key, tuple(policy.analyses))

    def role_arrays(role: str) -> Iterable[str] | None:
        return None if roles is None else roles.get(role, ())

    def first() -> list[str]:
        problems = role_problems(data, uses,
                                 public_names=None if roles is None else {a for names in roles.values() for a in names})
        if not problems and data.records() < need:
            problems.append(f"fewer records than the {need} this analysis needs at each site")
        if not problems:
            problems += label_problems(data, uses, min_cell)
            problems += near_copies(data, uses, min_cell, role_arrays, policy.analyses)
        return problems

    problems = _remembered(None if base is None else ("first", need, *base), first)
    if not problems and plan.data_check is not None:
        problems += plan.data_check(data, args, policy)
    if not problems:  # (several arrays at once, after the pairs: a composite outcome beside its parts)
        problems += _remembered(None if base is None else ("combinations", *base),
                                lambda: near_combinations(data, uses, min_cell, role_arrays, policy.analyses))
    return problems
