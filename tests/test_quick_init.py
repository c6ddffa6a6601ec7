"""`quick_init`: a frozen dataclass's faster `__init__` builds exactly what the generated one builds."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, strategies as st

from secagg_roc.messages import InputShare, Query, RoundId, RoundStatus
from secagg_roc.plans.base import Step
from secagg_roc.quick_init import quick_init
from secagg_roc.ring import shared_codec
from secagg_roc.sharing.base import Payload


def _pair():
    """The same class twice: with the generated `__init__`, and with `quick_init`'s."""

    def make():
        @dataclass(frozen=True)
        class Thing:
            a: int
            b: str = "b"
            c: list = field(default_factory=list)
            d: dict = field(default_factory=dict, init=False, compare=False)
            e: int = field(default=7, kw_only=True)
            made: int = field(default=0, init=False)

            def __post_init__(self) -> None:
                if self.a < 0:
                    raise ValueError("a must be >= 0")
                object.__setattr__(self, "made", self.made + 1)

        return Thing

    return make(), quick_init(make())


@given(st.integers(0, 10**6), st.text(max_size=5), st.lists(st.integers(), max_size=3), st.integers())
def test_quick_init_sets_the_same_fields_as_the_generated_init(a, b, c, e):
    plain, quick = _pair()
    want, got = plain(a, b, c, e=e), quick(a, b, c, e=e)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
    assert vars(got) == vars(want)  # every field, the init=False ones included, and nothing else
    assert got.made == 1  # __post_init__ ran once, after the fields were set


def test_quick_init_keeps_defaults_factories_and_the_signature():
    plain, quick = _pair()
    def shape(cls):
        return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(cls.__init__).parameters.values()]

    assert shape(quick) == shape(plain)
    x, y = quick(1), quick(1)
    assert (x.b, x.c, x.e) == ("b", [], 7)
    assert x.c is not y.c and x.d is not y.d  # a fresh value from each factory, per instance
    with pytest.raises(TypeError):
        quick(1, "b", [], 9)  # e is keyword-only, as declared


def test_quick_init_instances_stay_frozen_and_replace_as_before():
    _, quick = _pair()
    x = quick(3, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.a = 4  # type: ignore[misc]
    y = dataclasses.replace(x, a=5)
    assert (y.a, y.b, y.made) == (5, "x", 1)
    with pytest.raises(ValueError, match="a must be"):
        quick(-1)  # __post_init__'s checks still run


def test_quick_init_refuses_classes_it_cannot_serve_exactly():
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1

    for cls in (Mutable, Slotted, WithInitVar):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)


def test_the_protocol_messages_keep_their_checks_equality_and_pickling():
    rid = RoundId("study", 3, bytes(32))
    with pytest.raises(Exception, match="32 bytes"):
        RoundId("study", 3, bytes(31))  # RoundId's __post_init__ checks still run
    enc = shared_codec(20, 5, True).float_encoding
    layout = (("a", (2,), False),)
    share = InputShare(rid, "site1", 0, enc, 5, layout, vector=np.zeros(2, np.uint64))
    assert share == InputShare(rid, "site1", 0, enc, 5, layout, vector=np.ones(2, np.uint64))  # vector: compare=False
    assert share.dp_chain is None and share.seed is None
    again = pickle.loads(pickle.dumps(share))
    assert again == share and vars(again).keys() == vars(share).keys()
    assert RoundStatus(rid, ("site1",), False).accepted == ("site1",)
    assert Query(rid, "q", "{}").frac_bits == 32
    assert Payload().seed is None and Payload(vector=share.vector).vector is share.vector
    step = Step("rocglm.counts", {"b": np.array([1.0, 2.0])})
    assert step.params == {"b": [1.0, 2.0]} and step.derived == {}  # canonicalised by __post_init__
