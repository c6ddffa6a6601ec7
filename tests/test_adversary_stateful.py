"""A stateful hypothesis test: an adversarial analyst among honest sites and aggregators.

The analyst runs declared analyses with random (also forbidden) arguments,
repeats them, crafts rounds with raw messages (any query, run, step and
parameters; joins with crafted arguments; closes over chosen subsets), and
knocks sites offline and back. After every step, from everything the analyst
has ever received:

* no release outside a plan: every released round belongs to a run whose join
  the policy allows, and replaying that run's plan on its releases gives
  exactly the released rounds;
* no two exact releases whose contributor sets differ by fewer than
  min_sites sites or q records, and none below q records or min_sites;
* no site over its budget; every DP release is new and charged, or a replay
  of the same values.
"""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import secagg_roc as sr
from secagg_roc import DPPolicy, Policy
from secagg_roc.analyst import combine, combine_forwarded
from secagg_roc.layout import flatten
from secagg_roc.plans import PlanContext, RunInfo, get_plan, same_step
from secagg_roc.plans.runner import join_params
from secagg_roc.queries import QUERIES

SITES = ("a", "b", "c", "d", "e")
Q, MIN_SITES = 4, 2
POLICY = Policy(privacy_level=Q, min_sites=MIN_SITES, min_cell_count=3, allow_dropouts=True, calibration_bins=5,
                rocglm_thresholds=10, roles={"label": ["y"], "score": ["score"], "covariate": ["x"]},
                dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.02,
                                                  budget_epsilon=1.0, budget_delta=0.5))


def _data():
    rng = np.random.default_rng(11)
    out = {}
    for k, site in enumerate(SITES):
        n = 6 + 3 * k
        y = np.r_[[0, 1] * 2, rng.integers(0, 2, n - 4)]
        out[site] = {"y": y, "score": np.clip(0.2 + 0.5 * y + 0.3 * rng.random(n), 0, 1), "x": rng.normal(0, 1, n)}
    return out


ANALYSES = st.sampled_from([
    ("brier", {"label": "y", "score": "score"}),
    ("calibration", {"label": "y", "score": "score"}),
    ("calibration", {"label": "y", "score": "score", "n_bins": 3}),
    ("glm", {"y": "y", "X": ["x"], "family": "logit"}),
    ("glm", {"y": "y", "X": ["y"]}),
    ("rocglm", {"label": "y", "score": "score"}),
    ("rocglm", {"label": "y", "score": "score", "epsilon": 0.4, "delta": 0.3}),
    ("rocglm", {"label": "y", "score": "score", "epsilon": 0.45, "delta": 0.2}),
    ("rocglm", {"label": "y", "score": "score", "epsilon": 1e10, "delta": 0.3}),
    ("rocglm", {"label": "y", "score": "score", "l2_sensitivity": 1e-12}),
    ("rocglm", {"label": "y", "score": "score", "epsilon": None}),
    ("sensitivity", {"covariates": ["x"], "score": "score"}),
])
PARAM_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(-1e6, 1e6, allow_nan=False),
                         st.sampled_from(["y", "score", "x", "a"]), st.lists(st.floats(0, 1), max_size=4))


class AdversarialAnalyst(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.study = sr.Study.local(_data(), policy=POLICY, seed=5, transcripts=True)
        self.fed = self.study.federation
        self.answers = {s: site.answer for s, site in self.study.site_objects.items()}
        self.down: set[str] = set()
        self.run_ids: list[str] = ["never-joined"]
        self.last_query = None

    # -- moves ---------------------------------------------------------------------------

    @rule(analysis=ANALYSES)
    def run_declared_analysis(self, analysis):
        name, args = analysis
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self.study.run(name, **args)
                event(f"{name}: released")
            except (sr.SecAggError, ValueError, ArithmeticError) as exc:
                event(f"{name}: refused ({type(exc).__name__})")

    @rule(site=st.sampled_from(SITES))
    def toggle_site(self, site):
        if site in self.down:
            self.down.discard(site)
            self.study.site_objects[site].answer = self.answers[site]
        else:
            self.down.add(site)

            def unreachable(query, _site=site, **kw):
                raise sr.SiteQueryError(f"site {_site!r} is unreachable")

            self.study.site_objects[site].answer = unreachable

    @rule(query=st.sampled_from(sorted(QUERIES)), latest=st.booleans(), step=st.integers(0, 3),
          extra=st.dictionaries(st.sampled_from(["label", "score", "score_range", "n_bins", "min_cell", "sigma", "beta",
                                                 "design", "non_private", "analysis", "args"]), PARAM_VALUES, max_size=4))
    def raw_round(self, query, latest, step, extra):
        """A crafted round: any query and parameters, in the latest crafted run (joined or not) or in none."""
        params = {**extra, "run": self.run_ids[-1], "step": step} if latest else dict(extra)
        try:
            if QUERIES[query].release == "dp":
                self.study.release_dp(query, params)
            else:
                self.study.aggregate(query, params)
            event("raw round: released")
        except sr.SecAggError:
            event("raw round: refused")

    @rule(key=st.sampled_from(["score_range", "min_cell", "n_bins", "beta", "sigma", "center", "label"]),
          value=PARAM_VALUES, bump_step=st.booleans())
    def tamper_with_the_next_step(self, key, value, bump_step):
        """A fresh run of a declared analysis, then its first step with one parameter (or its step number) changed."""
        self.crafted_join(("brier", {"label": "y", "score": "score"}) if value is None else
                          ("calibration", {"label": "y", "score": "score"}), {})
        run = self.run_ids[-1]
        up = [s for s in SITES if s not in self.down]
        if not up:
            return
        site = self.study.site_objects[up[0]]
        try:
            _, step = site.runs.expect({"run": run, "step": site.runs.runs[run].number})
        except (sr.SecAggError, KeyError):
            return
        number = site.runs.runs[run].number + (1 if bump_step else 0)
        params = {**step.params, key: value, "run": run, "step": number}
        try:
            if step.release == "dp":
                self.study.release_dp(step.query, params)
            else:
                self.study.aggregate(step.query, params, frac_bits=step.frac_bits)
            event("tampered step: released")
        except sr.SecAggError:
            event("tampered step: refused")

    @rule(analysis=ANALYSES, tamper=st.dictionaries(st.sampled_from(["sigma", "thresholds", "n_bins", "mode"]),
                                                    PARAM_VALUES, max_size=2))
    def crafted_join(self, analysis, tamper):
        name, args = analysis
        run = f"j{len(self.run_ids)}"
        self.run_ids.append(run)
        try:
            args = sr.plans.declared(get_plan(name), POLICY, args)
        except (sr.SecAggError, ValueError):
            pass
        try:
            self.study.aggregate("run.join", join_params(run, name, {**args, **tamper}, POLICY.digest()))
            event("crafted join: released")
        except sr.SecAggError:
            event("crafted join: refused")

    @rule(subset=st.sets(st.sampled_from(SITES), min_size=1))
    def close_over_a_chosen_subset(self, subset):
        open_rounds = [r for a in self.fed.aggregators for r in a.rounds.values() if r.released_over is None
                       and r.state.value == "open"]
        if not open_rounds:
            return
        query = open_rounds[-1].query
        try:
            self.fed._collect(query, sorted(set(SITES) - self.down), lambda n: self.study.site_objects[n].answer(query))
            self.fed._close(query, tuple(sorted(subset)))
        except sr.SecAggError:
            pass

    # -- what the analyst holds ----------------------------------------------------------------

    def _released(self):
        size = len(self.fed.transcript("analyst"))
        if getattr(self, "_cache", (None,))[0] != size:
            self._cache = (size, self._combine_releases())
        return self._cache[1]

    def _combine_releases(self):
        queries = {e.message.round_id.number: e.message for e in self.fed.transcript("aggregator-0")
                   if e.kind == "Query"}
        shares: dict[int, list] = {}
        for e in self.fed.transcript("analyst"):
            if e.kind in ("AggregateShare", "ForwardedShares"):
                shares.setdefault(e.message.round_id.number, []).append(e.message)
        out = {}
        for number, got in shares.items():
            got = list({m.aggregator: m for m in got}.values())
            if len(got) == 2:
                release = combine_forwarded(got, self.fed.scheme) if got[0].kind == "ForwardedShares" \
                    else combine(got, self.fed.scheme)
                out[number] = (queries[number], got[0], release)
        return out

    @invariant()
    def no_release_outside_a_plan(self):
        released = self._released()
        runs: dict[str, dict[int, tuple]] = {}
        for number, (query, share, release) in released.items():
            params = query.params
            assert isinstance(params.get("run"), str) and isinstance(params.get("step"), int), query
            runs.setdefault(params["run"], {})[params["step"]] = (query, share, release)
        for run, steps in runs.items():
            query, share, _ = steps[0]  # a release of a run needs its released join
            contributors = tuple(share.contributors)
            assert len(contributors) >= MIN_SITES and share.records >= Q
            plan = get_plan(query.params["analysis"])
            args = query.params["args"]
            assert sr.plans.declared(plan, POLICY, args) == args
            info = RunInfo(run, plan.name, args, contributors, share.records)
            rounds = plan.rounds(PlanContext(POLICY, info, len(SITES), "shadow"), args)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    step = next(rounds)
                    for t in range(1, max(steps) + 1):
                        query, share, release = steps[t]
                        asked = {k: v for k, v in query.params.items() if k not in ("run", "step", "contributors")}
                        assert query.params["contributors"] == list(contributors)
                        assert same_step(step, query.name, asked, query.frac_bits) is None, (run, t)
                        assert tuple(share.contributors) == contributors
                        step = rounds.send(release)
                except StopIteration:
                    assert max(steps) == t
                except (sr.SecAggError, ValueError, ArithmeticError):
                    assert max(steps) == t

    @invariant()
    def no_two_exact_releases_can_be_differenced(self):
        sets = {}
        for query, share, release in self._released().values():
            if share.kind == "AggregateShare":
                sets[frozenset(share.contributors)] = share.records
        for s1, r1 in sets.items():
            assert len(s1) >= MIN_SITES and r1 >= Q
            for s2, r2 in sets.items():
                if s1 == s2:
                    continue
                for part in (s1 - s2, s2 - s1):
                    assert not part or len(part) >= MIN_SITES, (s1, s2)
                if s1 < s2 or s2 < s1:
                    assert abs(r1 - r2) >= Q, (s1, s2)

    @invariant()
    def dp_releases_are_charged_once_or_replayed_within_budget(self):
        seen: dict[str, set] = {}
        for query, share, release in self._released().values():
            if share.kind == "ForwardedShares":
                for site, values in release.items():
                    seen.setdefault(site, set()).add(flatten(values)[1].tobytes())
        for site in SITES:
            ledger = self.study.ledger(site)
            assert ledger.spent().within_budget
            charged = [r for r in ledger.noisy.values() if r.charge is not None]
            assert len(seen.get(site, ())) <= len(ledger.noisy)  # each value set released was recorded
            assert len({r.key for r in charged}) == len(charged)  # and charged once


TestAdversarialAnalyst = AdversarialAnalyst.TestCase
TestAdversarialAnalyst.settings = settings(max_examples=2 * settings.default.max_examples, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
