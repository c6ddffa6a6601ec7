"""Column sums of a named array over the sites: the ``sum`` plan (not among the default analyses).

One secure round. The released total covers the run's contributor set and
meets q and min_sites like every release; a categorical column (whose sum
counts records of its values) takes part only where each of its values has
none or at least ``min_cell_count`` records at each site (`queries.groups`); a policy lists ``sum`` only where the
totals of its arrays may be released (e.g. for aggregate counts, or for
benchmarking the secure sum on real processes). Values are summed at the
study's precision (32 fractional bits); a site reduces any value beyond the
fixed-point range modulo the ring rather than refusing (a refusal would depend
on the data) or clipping it (a clipped site's total is a known constant, so the
release would be the total of the others: red team 18): the total is exact while
it is in range, and a function of the total alone when it is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from ..plans import PlanContext, Step, plan, run_analysis
from ..policy import Policy
from ..queries.copies import column_copies
from ..queries.groups import policy_pool, small_groups

if TYPE_CHECKING:
    from ..study import Study


def _declare(policy: Policy, args: dict[str, Any]) -> dict[str, Any]:
    array = args.get("array")
    if not isinstance(array, str):
        raise ValueError("array must be an array name")
    return {"array": array}


@plan("sum", declare=_declare, queries={"sum"}, uses=lambda args: [("covariate", args["array"])],
      data_check=lambda data, args, policy: small_groups(data, [("covariate", args["array"])], policy.min_cell_count,
                                                      pool=policy_pool(policy, data))
      or column_copies(data, [("covariate", args["array"])], policy.min_cell_count))
def sum_rounds(ctx: PlanContext, args: dict[str, Any]) -> Generator[Step, Any, np.ndarray]:
    """The ``sum`` plan: one secure sum."""
    total = yield Step("sum", {"array": args["array"]})
    return np.asarray(total["sum"])


def column_sums(study: "Study", array: str) -> np.ndarray:
    """The sum of `array` over every record of the run's contributing sites (the ``sum`` analysis)."""
    return run_analysis(study, "sum", {"array": array})
