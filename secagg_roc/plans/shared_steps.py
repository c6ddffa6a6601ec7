"""Run by each Site: its copy of a run's plan, with the steps computed once per process for every site.

A plan's steps are a function of the policy, the run (as its join fixed
it), the number of sites and the releases fed to it, and of nothing else
(`plans.base`: a site's name does not enter, only that it is not the
analyst). So the sites of one process (the embedded study's five) that
drive copies of the same run, fed with releases of the same content, would
compute the same steps five times over. Here the first site to reach a
step computes it and leaves it in a tree the others walk: a node per step,
its children keyed by the exact content of the release that led on from it
(every array's bytes, dtype and shape, the records and contributors). Each
site still combines and checks its own release (`Site.receive_release`),
takes only the child of its own release's content, checks every step
against the run's declared queries itself, and checks each round it is
asked against its own position in the tree. A release of other content (a
site fed differently) leads to a child of its own, computed by that site's
own generator, replayed from the run's start over the releases it received.

Nothing here depends on a site's data: the steps are public, and a site's
answers to them are computed from its own records, by itself.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

from ..analyst import Totals
from ..errors import SecAggError
from .base import Plan, PlanContext, Rounds, Step

#: The filter `warnings.simplefilter("ignore")` puts first.
_IGNORE_ALL = ("ignore", None, Warning, None, 0)
#: Runs whose trees a process keeps. The sites of a run find its tree at the join's release, which reaches
#: them all in one round: a few trees suffice (a forgotten tree's nodes live on with the sites walking them),
#: and more would hold the releases and generators of runs long over (64 doubled a simulation's GC time).
KEEP_TREES = 4
#: Children a node keeps (honest sites of one run all take one; more means sites were fed differently).
KEEP_CHILDREN = 8
#: Held while a tree is read or grown: sites in threads of one process (a generator runs in one at a time).
_LOCK = threading.RLock()


@dataclass(eq=False)
class Node:
    """One outcome of a plan copy: the next `Step`, or why the plan ended (`ended`)."""

    step: Step | None
    ended: str | None
    #: The generator positioned just after yielding `step`, until a site takes it on to a child.
    rounds: Rounds | None = None
    children: dict[Hashable, "Node"] = field(default_factory=dict)


def _outcome(advance: Callable[[], Any]) -> tuple[Any, str | None]:
    """(what the plan yielded, None) or (None, why it ended): a plan's warnings are the analyst's, not a site's."""
    try:
        if warnings.filters and warnings.filters[0] == _IGNORE_ALL:
            return advance(), None  # every warning is ignored already (a simulation's loop): no filter to set
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return advance(), None
    except StopIteration:
        return None, "its plan is complete"
    except (SecAggError, ValueError, ArithmeticError) as exc:
        # The plan stopped on the released totals (e.g. a singular Fisher information): so did the analyst's.
        return None, f"its plan stopped: {type(exc).__name__}"


def _arrays_key(arrays: dict) -> tuple | None:
    """(name, dtype, shape, bytes) of each array, in the mapping's order (a plan may iterate it); None if
    anything is not a plain numeric array."""
    try:
        key = tuple([(k, v.dtype, v.shape, v.tobytes()) for k, v in arrays.items()])
    except AttributeError:
        return None
    for k, v in arrays.items():
        if type(v) is not np.ndarray or v.dtype.hasobject or type(k) is not str:
            return None
    return key


def release_key(release: Any) -> Hashable | None:
    """The exact content of a release, as a dict key; None for a kind not recognised (never shared then).

    Totals (name -> array, with records and contributors), a per-site release (site -> name -> array),
    or the one float of a kept round. Floats by their bits: 0.0 and -0.0, or two NaNs, are told apart.

    The key of the last release keyed is kept with it: the sites of one process are handed the very same
    release object (`shared_releases.combined`: read-only arrays, never changed once handed out), and each
    would read all its bytes again."""
    global _LAST_KEY
    last = _LAST_KEY
    if last is not None and last[0] is release:
        return last[1]
    key = _release_key(release)
    _LAST_KEY = (release, key)  # one assignment: a thread reads the old pair or the new one, never a mix
    return key


#: (the release, its key) of the last release keyed (holding the release: its id is not reused meanwhile).
_LAST_KEY: tuple[Any, Hashable | None] | None = None


def _release_key(release: Any) -> Hashable | None:
    """`release_key`, computed."""
    kind = type(release)
    if kind is Totals:
        parts = _arrays_key(release)
        return None if parts is None else ("totals", release.records, release.contributors, parts)
    if kind is float:
        return "float", release.hex() if release == release else repr(release)
    if kind is dict:
        sites = []
        for site, arrays in release.items():
            parts = _arrays_key(arrays) if type(site) is str and type(arrays) is dict else None
            if parts is None:
                return None
            sites.append((site, parts))
        return "per-site", tuple(sites)
    return None


class SharedSteps:
    """The trees of the runs' plan copies in this process, keyed by everything a plan reads besides releases."""

    def __init__(self, keep: int = KEEP_TREES):
        self.keep = keep
        self._trees: OrderedDict[Hashable, Node] = OrderedDict()

    def root(self, plan: Plan, ctx: PlanContext, args: dict[str, Any], make: Callable[[], Rounds]) -> Node:
        """The first step of a site's copy of a run (computed with `make()`'s generator if no site has yet)."""
        from ..queries import params_json

        info = ctx.run
        args_text = params_json(args)
        # (A site's run holds the arguments it joined with as its RunInfo's: one text for both then.)
        run_args_text = args_text if info.args is args else params_json(info.args)
        key = (plan.name, args_text, ctx.policy.digest(), ctx.n_sites, ctx.party == "analyst",
               info.run, info.analysis, run_args_text, info.contributors, info.records)
        with _LOCK:
            return self._root(key, make)

    def _root(self, key: Hashable, make: Callable[[], Rounds]) -> Node:
        node = self._trees.get(key)
        if node is None:
            rounds = make()
            step, ended = _outcome(lambda: next(rounds))
            node = Node(step, ended, rounds if ended is None else None)
            self._trees[key] = node
            while len(self._trees) > self.keep:
                self._trees.popitem(last=False)
        else:
            self._trees.move_to_end(key)
        return node


#: The process's trees: every `SiteRuns` of the process shares them unless given its own.
SHARED = SharedSteps()


class PlanCopy:
    """One site's copy of one run's plan: its position in the shared tree, and the releases it was fed."""

    def __init__(self, make: Callable[[], Rounds], node: Node):
        self._make = make
        self.node = node
        self._fed: list[Any] = []

    def feed(self, release: Any) -> Node:
        """The node after `release` (this site's own combined release): shared if another site of the process
        was fed the same content, else computed here, by the generator at the node or this copy's own."""
        key = release_key(release)
        with _LOCK:
            child = self._child(key, release)
        self._fed.append(release)
        self.node = child
        return child

    def _child(self, key: Hashable | None, release: Any) -> Node:
        node = self.node
        child = node.children.get(key) if key is not None else None
        if child is None:
            rounds, node.rounds = node.rounds, None
            if rounds is None:
                rounds = self._replayed()
            step, ended = _outcome(lambda: rounds.send(release))
            child = Node(step, ended, rounds if ended is None else None)
            if key is not None and len(node.children) < KEEP_CHILDREN:
                node.children[key] = child
        return child

    def _replayed(self) -> Rounds:
        """A generator of this copy's own, moved to its node over the releases it was fed (the plan is
        deterministic: it yields the steps it yielded before)."""
        rounds = self._make()
        _outcome(lambda: next(rounds))
        for release in self._fed:
            _outcome(lambda: rounds.send(release))
        return rounds
