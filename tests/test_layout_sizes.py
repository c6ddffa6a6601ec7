"""A layout's size is found by identity for the layouts `flatten` made, and computed for any other."""

from __future__ import annotations

import numpy as np
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
