"""A DP release's ledger key text, written item by item, is the JSON the ledger has always digested."""

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
