"""A layout's size is found by identity for the layouts `flatten` made, and computed for any other; a round
checks every new layout object against its query's declared outputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from secagg_roc.layout import flatten
from secagg_roc.wire import layout_size


@given(st.dictionaries(st.sampled_from(["a", "b", "score", "info"]),
                       st.lists(st.integers(0, 4), min_size=0, max_size=3), min_size=1, max_size=4))
def test_the_size_of_a_flattened_layout_is_its_element_count_found_again_or_not(shapes):
    values = {name: np.zeros(tuple(shape)) for name, shape in shapes.items()}
    layout, flat = flatten(values)
    assert layout_size(layout) == flat.size == sum(v.size for v in values.values())
    # The same layout written afresh (another object, as one decoded from the wire) gives the same size.
    copy = tuple((str(n), tuple(int(d) for d in s), bool(i)) for n, s, i in layout)
    assert copy is not layout and layout_size(copy) == flat.size
    # A layout that merely shares a shape is not taken for the one kept.
    assert layout_size(copy + (("z", (3,), False),)) == flat.size + 3


def test_a_round_checks_each_new_layout_object_against_the_declared_outputs_and_skips_only_the_same_one():
    from secagg_roc.errors import RoundError
    from secagg_roc.messages import InputShare, Query, RoundId
    from secagg_roc.queries import query_digest
    from secagg_roc.ring import FixedPoint
    from secagg_roc.round import Round, RoundPolicy
    from secagg_roc.sharing import AdditiveSharing

    policy = RoundPolicy(frozenset({"a", "b", "c"}))
    rid = RoundId("s", 0, query_digest("s", "glm.fisher", {}, 32))
    r = Round(Query(rid, "glm.fisher", "{}", 32), 0, policy, AdditiveSharing(2))
    layout, flat = flatten({"score": np.zeros(2), "info": np.zeros((2, 2)), "deviance": np.zeros(1)},
                           {"score": "float", "info": "float", "deviance": "float"})
    enc = FixedPoint(32, max_sites=3).float_encoding

    def share(site, lay, n):
        return InputShare(rid, site, 0, enc, 10, lay, vector=np.zeros(n, dtype=np.uint64))

    assert r.submit(share("a", layout, flat.size))
    assert r.submit(share("b", layout, flat.size))  # the same object: taken without a second look
    wrong = (("deviance", (1,), False), ("info", (2, 2), False), ("scores", (2,), False))
    with pytest.raises(RoundError, match="declares"):
        r.submit(share("c", wrong, flat.size))
    assert sorted(r.accepted) == ["a", "b"]
