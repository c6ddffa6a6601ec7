"""Recycled buffers and direct-I/O side files: what the deployed round's CPU savings must never change.

- `RecyclingPool` never hands out a buffer anything still refers to (a view,
  an array, a message made from it), stays within its bounds, and serves
  any size;
- `SideFileWriter` writes exactly the body, owner-only, and fsyncs it, with
  O_DIRECT or (when the file system refuses it) without;
- a site agent lets go of a round's shares once every aggregator took them,
  re-creates identical ones if asked again, and the next round's shares
  never overwrite shares still held;
- through real aggregator processes, share bodies read into recycled
  buffers sum to the right totals, also with two runs' rounds open at once.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc.stats as sr
from secagg_roc.buffers import RecyclingPool
from secagg_roc.deploy import side_file
from secagg_roc.deploy.side_file import ALIGN, SideFileWriter
from secagg_roc.deploy.store import Store
from secagg_roc.errors import RoundError

from deploy_client import call_as as call
from deploy_client import make_query
from test_deploy_state import joined_agent, next_step, site_study  # noqa: F401  (site_study: a fixture)

# --------------------------------------------------------------------------- the pool


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), min_size=1, max_size=40))
def test_the_pool_never_hands_out_a_buffer_that_is_still_held(ops) -> None:
    pool = RecyclingPool(max_buffers=3, max_bytes=12000)
    held: list[tuple[object, bytes]] = []  # (what the holder keeps: a view or an array over it, its contents)
    for i, (drop, n) in enumerate(ops):
        if drop and held:
            held.pop(i % len(held))
            continue
        view = pool.bytes(n)
        assert len(view) == n and not view.readonly
        assert np.frombuffer(view, np.uint8).ctypes.data % mmap.PAGESIZE == 0  # page-aligned: O_DIRECT-ready
        pattern = bytes([i % 251 + 1]) * n
        view[:] = pattern
        keep = np.frombuffer(view, np.uint8)[: n // 2] if i % 3 == 0 else view.toreadonly()  # a part keeps it all
        held.append((keep, pattern[: len(keep)] if i % 3 == 0 else pattern))
        del view
        for kept, contents in held:
            assert bytes(kept) == contents  # nothing still held was handed out again
        assert len(pool) <= 3 and pool.kept_bytes <= 12000


def test_the_pool_reuses_a_free_buffer_and_serves_any_size() -> None:
    pool = RecyclingPool(max_buffers=2, max_bytes=1 << 20)
    first = pool.bytes(1000)
    address = np.frombuffer(first, np.uint8).ctypes.data
    del first
    again = pool.bytes(900)  # a free buffer that fits (not more than twice the size) is reused
    assert np.frombuffer(again, np.uint8).ctypes.data == address and len(again) == 900
    huge = pool.bytes(4 << 20)  # larger than the pool keeps: a fresh buffer, not kept
    huge[-1:] = b"x"
    assert len(huge) == 4 << 20 and len(pool) == 1 and pool.kept_bytes <= 1 << 20
    arr = pool.array(100, np.uint64)
    assert arr.dtype == np.uint64 and arr.shape == (100,) and arr.flags.writeable
    assert np.frombuffer(again, np.uint8).ctypes.data == address  # still the caller's
    assert pool.array(0).size == 0


def test_the_pool_is_safe_across_threads() -> None:
    pool = RecyclingPool(max_buffers=4, max_bytes=1 << 20)
    failures: list[str] = []

    def work(k: int) -> None:
        for i in range(300):
            view = pool.bytes(4096)
            mark = bytes([k]) * 4096
            view[:] = mark
            if bytes(view) != mark:  # another thread was handed the same buffer meanwhile
                failures.append(f"thread {k} round {i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(pool) <= 4


# --------------------------------------------------------------------------- side files


@pytest.mark.parametrize("n", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, (1 << 20) + 7, 3 << 20])
@pytest.mark.parametrize("where", ["bytes", "aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False])
def test_a_side_file_holds_exactly_the_body_owner_only(tmp_path: Path, n: int, where: str, direct: bool) -> None:
    data = os.urandom(n)
    if where == "bytes":
        body = data
    elif where == "aligned":
        body = RecyclingPool().bytes(n)
        body[:] = data
    else:
        buf = bytearray(n + 3)
        buf[3:] = data
        body = memoryview(buf)[3:]
    writer = SideFileWriter(direct)
    path = tmp_path / "x.blob"
    writer.write(path, body)
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):  # never overwrites
        writer.write(path, body)


def test_a_side_file_is_fsynced_before_write_returns(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(side_file.os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    SideFileWriter().write(tmp_path / "a.blob", b"z" * (ALIGN * 2 + 5))
    assert synced == [ALIGN * 2 + 5]  # once, with the body's exact size in place


def test_a_refused_direct_write_falls_back_to_a_plain_one(tmp_path: Path, monkeypatch) -> None:
    if not side_file._O_DIRECT:
        pytest.skip("no O_DIRECT here")
    real, calls = os.pwrite, []

    def refuse_direct(fd: int, data, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls.append(offset)
            if len(calls) == 2:  # the second direct write: e.g. a device with a larger block size
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(side_file.os, "pwrite", refuse_direct)
    monkeypatch.setattr(side_file, "SCRATCH", ALIGN)  # several direct writes for one body
    writer = SideFileWriter()
    data = os.urandom(5 * ALIGN + 11)
    writer.write(tmp_path / "a.blob", data)
    assert (tmp_path / "a.blob").read_bytes() == data and not writer.direct
    writer.write(tmp_path / "b.blob", data)  # from then on plain writes
    assert (tmp_path / "b.blob").read_bytes() == data


def test_a_store_logs_a_pooled_body_and_replays_it(tmp_path: Path) -> None:
    body = RecyclingPool().bytes(3 << 20)
    body[:] = os.urandom(len(body))
    expected = bytes(body)
    with Store(tmp_path / "a.sqlite", study="s", party="agg-1") as store:
        seq = store.append("share", 7, body.toreadonly(), party="site-a")
    body[:8] = b"reused!!"  # the buffer is reused after the append: the log holds its own copy
    with Store(tmp_path / "a.sqlite", study="s", party="agg-1") as store:
        (entry,) = store.entries()
    assert (entry.seq, entry.kind, entry.number, entry.party, entry.body) == (seq, "share", 7, "site-a", expected)


# --------------------------------------------------------------------------- a site's shares


def test_a_site_lets_go_of_acknowledged_shares_and_re_creates_identical_ones(
        site_study, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr("secagg_roc.site.POOLED_ELEMENTS", 1)  # these small share vectors come from the pool too
    agent, _, _ = joined_agent(site_study, tmp_path, "site-a")
    step = next_step(agent.site, 5, "run-1")
    answer = agent._answer(step)
    sent = [m[0] for m in answer.outputs]
    copies = [None if s.vector is None else s.vector.copy() for s in sent]
    agent._acked.add((5, 0))
    agent._drop_sent(5)
    assert agent.answers[5].outputs is not None  # one aggregator still has to take them
    agent._acked.add((5, 1))
    agent._drop_sent(5)
    assert agent.answers[5].outputs is None  # every aggregator took them: nothing of them is held
    vector = next(s.vector for s in sent if s.vector is not None)
    del answer
    later = agent._answer(next_step(agent.site, 6, "run-1"))  # its vector comes from the pool
    assert later.kind == "shares"
    fresh = next(m[0].vector for m in later.outputs if m[0].vector is not None)
    assert not np.shares_memory(fresh, vector)  # round 5's vector is still held (by `sent`): not handed out
    del vector
    for share, copy in zip(sent, copies):  # shares still held elsewhere (here: `sent`) are never overwritten
        if copy is not None:
            np.testing.assert_array_equal(share.vector, copy)
    redone = agent._recreate(step, agent.answers[5])  # an aggregator offers round 5 again
    assert redone.kind == "shares"
    for a, b in zip(sent, [m[0] for m in redone.outputs]):
        assert a == b
        if a.vector is not None:
            np.testing.assert_array_equal(a.vector, b.vector)
    agent.store.close()


# --------------------------------------------------------------------------- through the services


@pytest.mark.slow
def test_recycled_share_buffers_sum_right_also_with_two_runs_at_once(tmp_path: Path) -> None:
    from secagg_roc.deploy.local_cluster import LocalCluster

    d = 150_000  # 1.2 MB share bodies: read into the aggregators' recycled buffers
    rng = np.random.default_rng(5)
    vectors = {f"s{i}": rng.standard_normal(d) for i in range(3)}
    expected = sum(vectors.values())
    data = {s: {"x": v.reshape(1, d)} for s, v in vectors.items()}
    with LocalCluster(tmp_path / "c", data, data_format="npz", round_timeout_s=60.0, max_body_bytes=4 << 20,
                      privacy_level=1, log_level="WARNING", policy={"analyses": ["sum"]}) as cl:
        # Attacks on the recycled-buffer path first: a large body cut short, large bodies that are no share.
        for party in ("s0", "analyst"):
            cut_short(cl, party, claimed=3 << 20, sent=1 << 20)
        garbage = call(cl, "analyst", 0, lambda c: c.request("POST", "/v1/message", b"\xff" * (2 << 20)))
        assert garbage.status == 400 and b"bad magic" in bytes(garbage.body)
        big_query = make_query(cl.config.study_id, 7, "sum", {"array": "x", "pad": "p" * (2 << 20)})
        refused = call(cl, "analyst", 1, lambda c: c.request("POST", "/v1/message", big_query.encode()))
        assert refused.status == 400 and refused.body  # not a plan's round: refused, by its reply
        assert all(i["open_rounds"] == 0 for i in (call(cl, "analyst", j, lambda c: c.info()) for j in (0, 1)))
        with cl.study() as one, cl.study() as two:
            results: dict[str, list[np.ndarray]] = {"one": [], "two": []}
            errors: list[BaseException] = []

            def run(name: str, study) -> None:
                for _ in range(12):  # two analysts race for round numbers: a lost race is retried
                    if len(results[name]) == 3:
                        return
                    try:
                        results[name].append(sr.column_sums(study, "x"))
                    except RoundError as exc:
                        if "already used" not in str(exc):
                            errors.append(exc)
                            return
                    except BaseException as exc:
                        errors.append(exc)
                        return

            threads = [threading.Thread(target=run, args=item) for item in (("one", one), ("two", two))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            for total in results["one"] + results["two"]:
                np.testing.assert_allclose(total, expected, atol=3 * 2.0**-31)
            assert len(results["one"]) == len(results["two"]) == 3


def cut_short(cluster, party: str, *, claimed: int, sent: int) -> None:
    """POST a /v1/message body that stops after `sent` of its `claimed` bytes, then hang up (as `party`)."""
    import socket
    import ssl

    from secagg_roc.deploy.tls import client_ssl_context

    config = cluster.config
    p = config.party(party)
    agg = config.aggregators[0]
    ctx = client_ssl_context(config.ca_cert, p.cert, p.key)
    with socket.create_connection((agg.host, agg.port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=agg.host) as tls:
            tls.sendall(f"POST /v1/message HTTP/1.1\r\nHost: {agg.host}\r\nContent-Length: {claimed}\r\n"
                        "Content-Type: application/octet-stream\r\n\r\n".encode() + b"\0" * sent)
            try:
                tls.shutdown(socket.SHUT_RDWR)
            except (OSError, ssl.SSLError):
                pass
