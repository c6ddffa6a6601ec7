"""A site's split record (`site_log.split_record`): its keyed vector digests catch any changed share,
and records written with SHA-256 digests (before the GMAC) are still checked as such."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg_roc.deploy.site_log import MAC_KEY_BYTES, split_mismatch, split_record
from secagg_roc.messages import InputShare, RoundId
from secagg_roc.ring import FixedPoint
from secagg_roc.sharing import make_scheme

CODEC = FixedPoint(32, 16)
RID = RoundId("study", 7, bytes(32))


def _split(x: np.ndarray, scheme_name: str = "additive", n: int = 2) -> tuple[list[InputShare], dict]:
    scheme = make_scheme(scheme_name, n)
    seeds = None if scheme_name == "additive" else scheme.fresh_seeds()
    kwargs = {} if seeds is None else {"seeds": seeds}
    payloads = scheme.share(x, CODEC, **kwargs)
    layout = (("x", (x.size,), False),)
    shares = [InputShare(RID, "site-a", j, CODEC.encoding_for(x), 3, layout, seed=p.seed, vector=p.vector)
              for j, p in enumerate(payloads)]
    return shares, seeds


def _changed(shares: list[InputShare], index: int, element: int, delta: int) -> list[InputShare]:
    vec = shares[index].vector.copy()
    vec[element:element + 1] += np.uint64(delta)  # wraps mod 2^64, as ring arithmetic does
    return [dataclasses.replace(s, vector=vec) if j == index else s for j, s in enumerate(shares)]


@settings(max_examples=25, deadline=None)
@given(st.integers(100, 5000), st.data())
def test_a_gmac_split_record_accepts_the_same_shares_and_refuses_any_changed_element(n, data) -> None:
    x = np.random.default_rng(n).standard_normal(n)
    shares, _ = _split(x)
    record = split_record(shares)
    assert len(bytes.fromhex(record["mac_key"])) == MAC_KEY_BYTES and "correction_sha256" not in record
    assert split_mismatch(record, shares) is None
    holder = record["holder"]
    element = data.draw(st.integers(0, n - 1))
    delta = data.draw(st.integers(1, 2**64 - 1))
    assert "share vector" in split_mismatch(record, _changed(shares, holder, element, delta))


def test_each_split_record_draws_its_own_mac_key_and_the_tags_depend_on_it() -> None:
    shares, _ = _split(np.arange(1000.0))
    a, b = split_record(shares), split_record(shares)
    assert a["mac_key"] != b["mac_key"] and a["correction_gmac"] != b["correction_gmac"]
    again = split_record(shares, mac_key=bytes.fromhex(a["mac_key"]))
    assert again["correction_gmac"] == a["correction_gmac"]


def test_a_shamir_split_record_digests_every_vector_and_names_a_changed_one() -> None:
    shares, seeds = _split(np.linspace(-3, 3, 777), "shamir", 3)
    record = split_record(shares, seeds)
    assert set(record["vectors_gmac"]) == {"0", "1", "2"}
    assert split_mismatch(record, shares) is None
    assert "share vectors" in split_mismatch(record, _changed(shares, 2, 5, 1))


def test_a_record_written_with_sha256_digests_is_still_checked_with_sha256() -> None:
    shares, _ = _split(np.arange(2000.0))
    legacy = split_record(shares, sha256=True)
    assert "correction_sha256" in legacy and "mac_key" not in legacy and "correction_gmac" not in legacy
    assert split_mismatch(legacy, shares) is None
    assert "share vector" in split_mismatch(legacy, _changed(shares, legacy["holder"], 0, 1))


def test_a_record_with_a_malformed_mac_key_is_a_mismatch_not_a_crash() -> None:
    shares, _ = _split(np.arange(300.0))
    record = split_record(shares)
    assert split_mismatch({**record, "mac_key": "zz"}, shares) is not None
    assert "MAC key" in split_mismatch({**record, "mac_key": "00" * 5}, shares)
