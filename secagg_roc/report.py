"""The analyst's validation report: run the declared analyses, write what a statistician reads.

Run by the Analyst (``secagg-roc analyze`` on a deployed study; any `Study`
from Python). `analyze` runs the DP ROC-GLM with its AUC and DeLong interval,
the Brier score and the calibration curve under the study's policy, then
writes ``report.txt``, ``results.json``, the CSV tables of `exports` and, with
the [plot] extra, the plots. Every result names its contributing sites, and
every report carries an audit block: the software version, the SHA-256 of the
study file, start and end time, the rounds run and the DP releases requested
(each charged once to a contributing site's budget; an identical repeat is
replayed by the sites at no new charge).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import __version__
from .exports import write_plots, write_tables
from .extras import missing
from .outputs import output_folder

__all__ = ["ANALYSES", "analyze", "audit_block"]

#: The analyses of a validation report, in the order they run: (plan name, what it is called).
ANALYSES = (("rocglm", "ROC-GLM with DeLong CI"), ("brier", "Brier score"), ("calibration", "calibration curve"))

#: Called as ``progress(name, index, total, finished)``: before (False) and after (True) each analysis.
Progress = Callable[[str, int, int, bool], None]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _study_hash(study: Any) -> tuple[str | None, str | None]:
    """(path, SHA-256) of the study file `study` was read from, when it was read from one."""
    source = getattr(getattr(study, "config", None), "source", None)
    if source is None or not Path(source).is_file():
        return None, None
    return str(source), hashlib.sha256(Path(source).read_bytes()).hexdigest()


def audit_block(study: Any, started: str, finished: str, seconds: float, rounds: int | None,
                roc: Any) -> dict[str, Any]:
    """What a reader needs to check how a report was made (see the module docstring)."""
    path, digest = _study_hash(study)
    charges = []
    if roc.privacy and roc.mode in ("dp", "trusted-host"):
        p = roc.privacy
        charges.append({
            "analysis": "rocglm", "release": "each site's DP-noised scores (per-site release)",
            "epsilon": p.get("epsilon"), "delta": p.get("delta"), "l2_sensitivity": p.get("l2_sensitivity"),
            "mechanism": p.get("mechanism"), "sites": list(roc.contributors or ()),
            "note": "charged once to each contributing site's budget; an identical repeat is replayed at no charge",
        })
    return {
        "software": {"secagg-roc": __version__, "python": platform.python_version(), "numpy": np.__version__},
        "study_file": path, "study_sha256": digest, "policy_digest": study.policy.digest(),
        "started": started, "finished": finished, "seconds": round(seconds, 3), "rounds": rounds,
        "dp_releases": charges,
        "non_private": roc.mode in ("non-private", "trusted-host"),
    }


def _audit_text(audit: dict[str, Any]) -> list[str]:
    lines = ["Audit",
             f"  software: secagg-roc {audit['software']['secagg-roc']} (Python {audit['software']['python']}, "
             f"numpy {audit['software']['numpy']})",
             f"  study file: {audit['study_file'] or '(none: an embedded study)'}"
             + (f", SHA-256 {audit['study_sha256']}" if audit["study_sha256"] else ""),
             f"  policy digest: {audit['policy_digest']}",
             f"  started {audit['started']}, finished {audit['finished']} ({audit['seconds']:.2f} s)"
             + (f"; {audit['rounds']} rounds" if audit["rounds"] is not None else "")]
    for c in audit["dp_releases"]:
        lines.append(f"  DP release ({c['analysis']}): epsilon = {c['epsilon']:.6g}, delta = {c['delta']:.6g}, "
                     f"l2-sensitivity = {c['l2_sensitivity']:.6g}, {c['mechanism']} Gaussian mechanism; sites "
                     f"{', '.join(c['sites'])}; {c['note']}")
    if audit["non_private"]:
        lines.append("  NON-PRIVATE: see the ROC-GLM's note")
    return lines


def analyze(study: Any, out: str | Path, *, label: str = "y", score: str = "score", epsilon: float | str | None = "auto",
            delta: float | None = None, l2_sensitivity: float | None = None, mechanism: str | None = None,
            bins: int | None = None, alpha: float = 0.05, plot_formats: Sequence[str] = ("png",),
            progress: Progress | None = None) -> dict[str, Any]:
    """Run by the Analyst: ROC-GLM + CI, Brier score and calibration on any `Study`; write the report to `out`.

    Privacy comes from the study's policy; `epsilon`, `delta`, `l2_sensitivity`
    and `mechanism` may only ask for more noise, ``epsilon=None`` is the
    non-private mode (the policy must allow it), and `bins` must be the
    policy's calibration bins if given. Returns the results (as written to
    ``results.json``) with the printable ``report`` and the ``files`` written.
    """
    from .stats import brier_score, calibration_curve, roc_glm

    out = output_folder(out)
    policy = study.policy
    history = getattr(study, "history", None)
    rounds_before = len(history) if history is not None else None
    started, clock = _now(), time.perf_counter()
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("rocglm", lambda: roc_glm(study, label=label, score=score, epsilon=epsilon, delta=delta,
                                   l2_sensitivity=l2_sensitivity, mechanism=mechanism, alpha=alpha)),
        ("brier", lambda: brier_score(study, label, score)),
        ("calibration", lambda: calibration_curve(study, label, score, n_bins=bins)),
    ]
    done: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (name, run) in enumerate(runs):
            if progress is not None:
                progress(name, i, len(runs), False)
            done[name] = run()
            if progress is not None:
                progress(name, i, len(runs), True)
    seconds = time.perf_counter() - clock
    roc, brier, calibration = done["rocglm"], done["brier"], done["calibration"]
    rounds = len(history) - rounds_before if history is not None and rounds_before is not None else None
    audit = audit_block(study, started, _now(), seconds, rounds, roc)
    notes = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    contributors = {"roc_glm": list(roc.contributors or ()), "brier_score": list(brier.contributors or ()),
                    "calibration": list(calibration.contributors or ())}
    results: dict[str, Any] = {
        "study": getattr(study, "study_id", None), "sites": list(study.sites), "privacy_level": policy.privacy_level,
        "policy": policy.to_dict(), "policy_digest": policy.digest(), "contributors": contributors,
        "roc_glm": roc.to_dict(), "brier_score": float(brier), "brier": brier.to_dict(),
        "calibration": calibration.to_dict(), "warnings": notes, "seconds": seconds, "audit": audit,
    }

    files = write_tables(out, roc, calibration, alpha)
    if missing("plot") is None:
        try:
            files += write_plots(out, roc, calibration, plot_formats, alpha)
        except Exception as exc:  # a plot must never cost the analyst the results (and the sites' budget)
            notes.append(f"the plots could not be drawn: {type(exc).__name__}: {exc}")
    else:
        notes.append("no plots: they need the [plot] extra: pip install 'secagg-roc[plot]'")

    def sites(result: str) -> str:
        return f"contributing sites: {', '.join(contributors[result])}"

    report = "\n".join([
        f"Distributed validation of {score!r} against {label!r}",
        f"study {results['study']!r}: {len(study.sites)} sites ({', '.join(study.sites)})",
        f"policy {policy.digest()[:12]}: {policy.describe()}",
        "", repr(roc), sites("roc_glm"),
        "", f"Brier score ({brier.mode}): {float(brier):.6f} over {brier.n_records} records", sites("brier_score"),
        "", repr(calibration), sites("calibration"),
        "", *(f"warning: {n}" for n in notes), *_audit_text(audit),
    ])
    text_file, json_file = out / "report.txt", out / "results.json"
    files = [text_file, json_file, *files]
    results["files"] = [str(f) for f in files]
    text_file.write_text(report + "\n", encoding="utf-8")
    json_file.write_text(json.dumps(results, indent=2, default=_json_default) + "\n", encoding="utf-8")
    results["report"] = report
    return results


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
