"""``secagg-roc site check``: a site's data against the study's policy, checked locally.

Run by a Site's operator before the site joins a study (and at any time
after): it reads the site's data file and its agent's ledger, prints what
would stop a run, and sends nothing anywhere. Wired into the CLI by
`cli_services`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["site_check"]


def site_check(study: Any, name: str, *, state_path: str | Path | None = None) -> tuple[str, bool]:
    """Run by a Site's operator: its data against the study's policy; (report text, True when nothing to fix).

    For the policy's roles (or, with no roles, every column in every role)
    what `queries.checks.role_problems` finds; how many scores lie outside
    the policy's score range (clipped in every analysis); the record count
    against q (a site with fewer takes no part in per-site DP releases); the
    allowed analyses whose runs may send a query the site's `allowed_queries`
    lack (such a run is refused at its join: the operator's choice, not a
    problem); and what the site's ledger has released so far. Local only: nothing leaves the site.
    """
    # Imported here, not at the top: the CLI imports this module when it starts, for every command.
    import numpy as np

    from ..plans import PLANS
    from ..policy import ROLES
    from ..queries import SiteData
    from ..queries.checks import out_of_range, role_problems
    from ..queries.combinations import near_combinations
    from ..queries.copies import column_copies, near_copies
    from ..queries.groups import label_problems, small_groups
    from .config_read import load_study
    from .config_schema import SiteConfig, with_article
    from .site_data import load_site_data
    from .site_log import default_state_path, read_ledger

    config = study if not isinstance(study, (str, Path)) else load_study(study)
    party = config.party(name)
    if not isinstance(party, SiteConfig):
        raise ConfigError(f"{name!r} is {with_article(party.role)} of study {config.study_id!r}, not a site")
    policy = config.policy
    data = SiteData(name, load_site_data(party.data, party.columns))
    records = data.records()
    lo, hi = policy.score_range
    lines = [
        f"site {name!r} of study {config.study_id!r}: {records} records from {party.data}",
        f"policy {policy.digest()[:12]}: {policy.describe()}",
        f"analyses allowed: {', '.join(policy.analyses)}",
    ]
    if party.allowed_queries is not None:
        # Each plan declares its queries; a run declaring one the whitelist lacks is refused at the join.
        allowed = set(party.allowed_queries)
        lines.append(f"allowed_queries: {len(allowed)} site queries")
        for analysis in policy.analyses:
            missing = sorted(PLANS[analysis].queries - allowed) if analysis in PLANS else []
            if missing:
                lines.append(f"  {analysis}: a run that sends {', '.join(missing)} is refused at its join "
                             "(not in allowed_queries)")
    lines.append("")
    problems: list[str] = []

    def check(role: str, array: str) -> list[str]:
        return role_problems(data, [(role, array)], detail=True)  # counts: for the operator, never the analyst

    def column(array: str, j: int | None = None) -> str:
        """Where the operator fixes `array` (column j of a matrix): the study file maps it to CSV columns."""
        col = party.columns.get(array)
        if col is None:
            return f"array {array!r}"
        if isinstance(col, str):
            return f"CSV column {col!r}"
        return f"CSV column {col[j]!r}" if j is not None and j < len(col) else \
            "CSV columns " + ", ".join(repr(c) for c in col)

    def shown(array: str, j: int | None) -> str:  # `queries.groups` names columns this way for the operator
        return f"{array} ({column(array, j)})" if j is None else f"{array}[{j}] ({column(array, j)})"

    def rows(array: str, role: str) -> str:
        """The data rows that break `role` (or lie outside the score range), for the operator to look up."""
        a = np.asarray(data.arrays.get(array, []), dtype=np.float64)
        if a.ndim != 1 or a.size == 0:
            return ""
        bad = ~np.isfinite(a)
        if role == "label":
            bad |= ~np.isin(a, (0.0, 1.0))
        elif role == "score" and not bad.any():
            bad = (a < lo) | (a > hi)
        found = np.flatnonzero(bad) + 1
        if not found.size:
            return ""
        more = f" and {found.size - 8} more" if found.size > 8 else ""
        return f"; data rows {', '.join(str(r) for r in found[:8])}{more}"

    if policy.roles is not None:
        lines.append("arrays in the roles the policy allows:")
        uses = [(role, array) for role in ROLES for array in policy.roles.get(role, ())]
        for role, array in uses:
            found = check(role, array)
            note = ""
            if not found and role == "score":
                outside = out_of_range(data, array, lo, hi)
                if outside:  # a note, not a problem: clipping is how the policy's range is kept
                    note = (f" ({outside} score(s) outside the policy's score range [{lo:g}, {hi:g}] "
                            f"will be clipped to it{rows(array, role)})")
            where = f" -- {column(array)} of {party.data.name}"
            text = "ok" + note if not found else "; ".join(found) + rows(array, role)
            lines.append(f"  {role} {array!r}: {text}{where}")
            problems += [f"{role} {array!r} ({column(array)}): {p}" for p in found]
        joint = [p for p in role_problems(data, uses, detail=True) if p not in {q for u in uses for q in check(*u)}]
        for p in joint:
            lines.append(f"  {p}")
        problems += joint
        # Small groups keep the site out of a run (not a fault of the data): notes, as the runs will see them.
        # Only for arrays without a problem of their own (a label of 0/2 is no small-class question).
        fine = [u for u in uses if not check(*u)]
        groups = label_problems(data, fine, policy.min_cell_count, shown)
        groups += small_groups(data, [u for u in fine if u[0] != "score"], policy.min_cell_count, shown)
        # Near copies and near combinations among all the policy's arrays at once: a run over any of them
        # together is refused at its join (pairs of a covariate matrix's columns too, as a GLM judges them).
        in_role = policy.roles.get
        groups += near_copies(data, fine, policy.min_cell_count, lambda role: in_role(role, ()), policy.analyses)
        groups += column_copies(data, [u for u in fine if u[0] == "covariate"], policy.min_cell_count)
        if not groups:  # (after the pairs, as at a join)
            groups += near_combinations(data, fine, policy.min_cell_count, lambda role: in_role(role, ()),
                                      policy.analyses)
        if groups and not joint:
            lines.append(f"small groups and near copies (this site does not join a run that uses them together, "
                         f"q-style rule min_cell_count = {policy.min_cell_count}):")
            lines += [f"  {g}" for g in dict.fromkeys(groups)]
    else:
        lines.append("the policy declares no roles: every array may play any role; what each can be:")
        lengths = {}
        for array in data.arrays:
            usable, why = [], []
            for role in ROLES:
                found = check(role, array)
                (why.append(f"not {role} ({'; '.join(found)})") if found else usable.append(role))
            text = f"can be {', '.join(usable)}" if usable else "can play no role"
            if "score" in usable:
                outside = out_of_range(data, array, lo, hi)
                if outside:
                    text += (f"; as a score, {outside} value(s) lie outside the policy's score range "
                             f"[{lo:g}, {hi:g}] and would be clipped")
            lines.append(f"  {array!r}: {text}" + (f"; {'; '.join(why)}" if why and usable else "")
                         + f" -- {column(array)}")
            if not usable:
                problems.append(f"{array!r} can play no role: {'; '.join(why)}")
            lengths[array] = int(np.asarray(data.arrays[array]).shape[0]) if np.ndim(data.arrays[array]) else 1
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{n}: {k}" for n, k in sorted(lengths.items()))
            problem = f"arrays must have one entry per record; lengths differ ({detail})"
            lines.append(f"  {problem}")
            problems.append(problem)
    short = sorted(a for a in policy.analyses if a in PLANS and records < PLANS[a].min_records(policy))
    lines.append("")
    if short:
        needs = ", ".join(f"{a} ({PLANS[a].min_records(policy)})" for a in short)
        text = f"records: {records}, too few to take part in: {needs}"
        problems.append(text)
        lines.append(text)
    else:
        lines.append(f"records: {records} (q = {policy.privacy_level}): enough to take part in every analysis")
    path = Path(state_path) if state_path is not None else default_state_path(config, name)
    if path.exists():
        summary = read_ledger(path, policy, name).summary()
        lines.append(f"ledger ({path}): " + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in summary.items()))
    lines += ["", f"{len(problems)} problem(s)" if problems else "no problems: the site is ready"]
    return "\n".join(lines), not problems
