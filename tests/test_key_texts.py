"""Keys and digests written piece by piece are the JSON texts they were digested from before (a DP release's
ledger key, a site's data digest): deployed ledgers keep them."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from secagg_roc.site_releases import release_key_text

_SORTED_JSON = json.JSONEncoder(sort_keys=True).encode

texts = st.text(max_size=12)  # any text: quotes, backslashes, non-ASCII and control characters included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=12,
)


@given(texts, texts, st.dictionaries(texts, json_values, max_size=4), texts,
       st.none() | st.lists(texts, max_size=5).map(tuple))
def test_release_key_text_is_the_sorted_json_of_the_whole_list(study, query, params, digest, contributors):
    parts = [study, query, params, digest] + ([] if contributors is None else [sorted(contributors)])
    assert release_key_text(study, query, _SORTED_JSON(params), digest, contributors) == _SORTED_JSON(parts)


@given(st.one_of(texts, st.integers()),
       st.sampled_from(["<f8", "<i8", "|b1", "<U3", "|S2", "<M8[ns]", ">f4", "<c16"]),
       st.lists(st.integers(0, 5), max_size=3))
def test_a_sites_data_digest_writes_each_arrays_header_as_json_dumps_did(name, dtype, shape):
    import numpy as np

    from secagg_roc.queries.registry import _array_header

    a = np.zeros(tuple(shape), dtype=dtype)
    assert _array_header(name, a) == json.dumps([name, a.dtype.str, list(a.shape)])
