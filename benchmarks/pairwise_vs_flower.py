"""Pairwise-masking secure aggregation: secagg-roc's engine vs Flower's SecAgg+ primitives, in one run.

    python benchmarks/pairwise_vs_flower.py                 # K = 10, 100; d = 1e3 .. 1e6
    python benchmarks/pairwise_vs_flower.py --quick         # d <= 1e4, one repeat
    python benchmarks/pairwise_vs_flower.py --max-d 100000 --drop 1

Needs Flower (benchmark-only): pip install flwr==1.42.0 --no-deps plus its SecAgg+ imports
(see the `bench-flower` extra). For each K (sites) and d (vector length), both protocols use the
same neighbourhood (k neighbours: all for K = 10, SecAgg+'s sparse ring lattice of k = 20 for
K = 100) and the same threshold t, and `--drop` sites drop after sharing keys.

Per-client cost: what one site computes in a round: key generation, sharing keys (Shamir +
encryption), decrypting its neighbours' shares, encoding and masking one float vector, answering
the unmask request. Per-round server cost (unmasking): summing the masked vectors, rebuilding the
survivors' self-mask seeds and the dropouts' mask keys, removing the masks, decoding.

Flower's side composes `flwr.common.secure_aggregation` exactly as `secaggplus_mod` (client) and
`SecAggPlusWorkflow.unmask_stage` (server) do: SECP384R1 keys serialized as PEM, ECDH + HKDF +
Fernet, pycryptodome Shamir over GF(2^128) on 16-byte chunks, stochastic quantization to
[0, 2^22) after clipping to [-8, 8], masks from numpy's RandomState modulo 2^32 (Flower's defaults).
Ours keeps full 64-bit fixed point (FixedPoint(frac_bits=32): exact sums, no clipping) and masks
with AES-128-CTR. Where one Flower point would take too long, its per-client masking cost is
measured on a few clients and the mean is reported (marked "*"); the server cost is always
measured in full. Ratios > 1 mean ours is faster.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

import numpy as np

from secagg_roc.pairwise import PairwiseClient, PairwiseServer, default_degree, neighbour_graph
from secagg_roc.ring import FixedPoint

FLOWER_CLIP, FLOWER_TARGET, FLOWER_MOD = 8.0, 1 << 22, 1 << 32  # SecAggPlusWorkflow defaults


def setting(n_sites: int) -> tuple[dict[int, frozenset[int]], int]:
    """The neighbour graph and threshold both protocols use at K sites."""
    k = default_degree(n_sites) if n_sites > 16 else n_sites - 1
    graph = neighbour_graph(n_sites, k, b"benchmark")
    return graph, (k + 1) // 2 + 1


# ----------------------------------------------------------------- ours


def ours_round(xs: dict[int, np.ndarray], graph, t: int, dropped: set[int]) -> tuple[float, float, np.ndarray]:
    """One round of our engine: (mean per-client seconds, server seconds, total)."""
    codec = FixedPoint(frac_bits=32, max_sites=len(xs))
    rid = secrets.token_bytes(16)
    sites = sorted(xs)
    client_t = dict.fromkeys(sites, 0.0)
    server_t = 0.0

    def timed(site, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        client_t[site] += time.perf_counter() - t0
        return out

    server = PairwiseServer(rid, sites, t, graph)
    clients = {s: PairwiseClient(s, rid, t, graph[s]) for s in sites}
    for s in sites:
        server.receive_keys(timed(s, clients[s].advertise_keys))
    for s in sites:
        server.route(timed(s, clients[s].share_keys, server.keys_for(s)))
    masked = []
    for s in sites:
        if s in dropped:
            continue
        timed(s, clients[s].receive_shares, server.shares_for(s))
        masked.append(timed(s, lambda s=s: clients[s].mask(codec.encode(xs[s]), in_place=True)))  # as the library does
    t0 = time.perf_counter()
    for m in masked:
        server.receive_masked(m)
    request = server.unmask_request()
    server_t += time.perf_counter() - t0
    responses = [timed(s, clients[s].unmask, request) for s in sites if s not in dropped]
    t0 = time.perf_counter()
    for r in responses:
        server.receive_unmask(r)
    total = codec.decode(server.total())
    server_t += time.perf_counter() - t0
    return statistics.mean(client_t[s] for s in sites if s not in dropped), server_t, total


# ----------------------------------------------------------------- Flower (its primitives, composed as its mod does)


class FlowerSecAggPlus:
    """Flower 1.42's SecAgg+ client and server steps, from `flwr.common.secure_aggregation`."""

    def __init__(self, graph, t: int, dropped: set[int]):
        from flwr.common.secure_aggregation.crypto import shamir, symmetric_encryption as sym
        from flwr.common.secure_aggregation import ndarrays_arithmetic as arith, quantization, secaggplus_utils as utils
        from flwr.supercore.primitives import asymmetric as asym

        self.shamir, self.sym, self.arith, self.quant, self.utils, self.asym = shamir, sym, arith, quantization, utils, asym
        self.graph, self.t, self.dropped = graph, t, dropped
        self.sites = sorted(graph)
        self.state: dict[int, dict] = {}

    def keys_phase(self) -> dict[int, float]:
        """Setup (two key pairs), share keys, decrypt received shares: seconds per site (d-independent)."""
        asym, sym, shamir, utils = self.asym, self.sym, self.shamir, self.utils
        cost = dict.fromkeys(self.sites, 0.0)
        for s in self.sites:  # _setup
            t0 = time.perf_counter()
            sk1, pk1 = asym.generate_key_pairs()
            sk2, pk2 = asym.generate_key_pairs()
            self.state[s] = dict(sk1=asym.private_key_to_bytes(sk1), pk1=asym.public_key_to_bytes(pk1),
                                 sk2=asym.private_key_to_bytes(sk2), pk2=asym.public_key_to_bytes(pk2),
                                 b_shares={}, sk1_shares={}, ss2={}, inbox=[])
            cost[s] += time.perf_counter() - t0
        for s in self.sites:  # _share_keys: the neighbourhood includes the site itself
            t0 = time.perf_counter()
            st = self.state[s]
            hood = sorted(self.graph[s] | {s})
            st["rd_seed"] = os.urandom(32)
            b_shares = shamir.create_shares(st["rd_seed"], self.t, len(hood))
            sk1_shares = shamir.create_shares(st["sk1"], self.t, len(hood))
            for idx, v in enumerate(hood):
                if v == s:
                    st["b_shares"][s], st["sk1_shares"][s] = b_shares[idx], sk1_shares[idx]
                    continue
                key = sym.generate_shared_key(asym.bytes_to_private_key(st["sk2"]),
                                              asym.bytes_to_public_key(self.state[v]["pk2"]))
                st["ss2"][v] = key
                plain = utils.share_keys_plaintext_concat(s, v, b_shares[idx], sk1_shares[idx])
                self.state[v]["inbox"].append((s, sym.encrypt(key, plain)))
            cost[s] += time.perf_counter() - t0
        for s in self.sites:  # start of _collect_masked_vectors: decrypt and store the shares
            if s in self.dropped:
                continue
            t0 = time.perf_counter()
            st = self.state[s]
            for src, ct in st["inbox"]:  # dropouts left after sharing keys: their shares arrived too
                _, _, b, sk1 = utils.share_keys_plaintext_separate(sym.decrypt(st["ss2"][src], ct))
                st["b_shares"][src], st["sk1_shares"][src] = b, sk1
            cost[s] += time.perf_counter() - t0
        return cost

    def mask(self, s: int, x: np.ndarray) -> list[np.ndarray]:
        """_collect_masked_vectors after decryption: weight, quantize, add self and pairwise masks, mod."""
        arith, quant, utils, asym, sym = self.arith, self.quant, self.utils, self.asym, self.sym
        st = self.state[s]
        q_ratio = round(1.0 * FLOWER_TARGET)  # num_examples / max_weight = 1
        params = arith.parameters_multiply([x], q_ratio / FLOWER_TARGET)
        params = quant.quantize(params, FLOWER_CLIP, FLOWER_TARGET)
        params = arith.factor_combine(q_ratio, params)
        dims = [a.shape for a in params]
        params = arith.parameters_addition(params, utils.pseudo_rand_gen(st["rd_seed"], FLOWER_MOD, dims))
        for v in sorted(self.graph[s]):  # every neighbour whose shares it received (later dropouts included)
            key = sym.generate_shared_key(asym.bytes_to_private_key(st["sk1"]),
                                          asym.bytes_to_public_key(self.state[v]["pk1"]))
            mask = utils.pseudo_rand_gen(key, FLOWER_MOD, dims)
            params = (arith.parameters_addition if s > v else arith.parameters_subtraction)(params, mask)
        return arith.parameters_mod(params, FLOWER_MOD)

    def unmask_response(self, s: int, active: set[int], dead: set[int]) -> list[tuple[int, bytes]]:
        st, hood = self.state[s], self.graph[s] | {s}
        return ([(v, st["b_shares"][v]) for v in hood & active]
                + [(v, st["sk1_shares"][v]) for v in hood & dead if v in st["sk1_shares"]])

    def server(self, masked: list[list[np.ndarray]], responses: list[list[tuple[int, bytes]]],
               active: set[int]) -> np.ndarray:
        """collect_masked_vectors_stage's sum + unmask_stage: rebuild, remove masks, dequantize."""
        arith, quant, utils, asym, sym, shamir = self.arith, self.quant, self.utils, self.asym, self.sym, self.shamir
        vec = masked[0]
        for m in masked[1:]:
            vec = arith.parameters_addition(vec, m)
        vec = arith.parameters_mod(vec, FLOWER_MOD)
        collected: dict[int, list[bytes]] = {s: [] for s in self.sites}
        for resp in responses:
            for owner, share in resp:
                collected[owner].append(share)
        dims = [a.shape for a in vec]
        for nid, shares in collected.items():
            if not shares:
                continue
            secret = shamir.combine_shares(shares[: self.t])
            if nid in active:
                vec = arith.parameters_subtraction(vec, utils.pseudo_rand_gen(secret, FLOWER_MOD, dims))
            else:
                for v in sorted(self.graph[nid] & active):
                    key = sym.generate_shared_key(asym.bytes_to_private_key(secret),
                                                  asym.bytes_to_public_key(self.state[v]["pk1"]))
                    mask = utils.pseudo_rand_gen(key, FLOWER_MOD, dims)
                    vec = (arith.parameters_addition if nid > v else arith.parameters_subtraction)(vec, mask)
        recon = arith.parameters_mod(vec, FLOWER_MOD)
        q_total, recon = arith.factor_extract(recon)
        (out,) = quant.dequantize(recon, FLOWER_CLIP, FLOWER_TARGET)
        out += -(len(active) - 1) * FLOWER_CLIP
        out *= FLOWER_TARGET / q_total
        return out  # Flower returns the (weighted) mean


def flower_point(fl: FlowerSecAggPlus, key_cost: dict[int, float], xs, budget_clients: int | None):
    """(mean per-client seconds, server seconds, mean vector or None, number of clients masked)."""
    active = set(fl.sites) - fl.dropped
    order = sorted(active)
    measured = order if budget_clients is None else order[:budget_clients]
    masked, mask_cost = {}, []
    for s in measured:
        t0 = time.perf_counter()
        masked[s] = fl.mask(s, xs[s])
        mask_cost.append(time.perf_counter() - t0)
    # Unmeasured clients' vectors: reuse measured ones (the server's work is the same; the result is not checked).
    vectors = [masked[s] if s in masked else masked[measured[i % len(measured)]] for i, s in enumerate(order)]
    t0 = time.perf_counter()
    responses = [fl.unmask_response(s, active, fl.dropped) for s in order]
    resp_cost = (time.perf_counter() - t0) / len(order)
    t0 = time.perf_counter()
    mean = fl.server(vectors, responses, active)
    server_s = time.perf_counter() - t0
    client_s = statistics.mean(key_cost[s] for s in order) + statistics.mean(mask_cost) + resp_cost
    return client_s, server_s, (mean if len(measured) == len(order) else None), len(measured)


# ----------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="d <= 1e4 and one repeat")
    parser.add_argument("--max-d", type=float, default=1e6, help="largest vector length (default 1e6)")
    parser.add_argument("--repeats", type=int, default=3, help="median over this many rounds (default 3)")
    parser.add_argument("--drop", type=int, default=0, help="sites that drop after sharing keys (default 0)")
    parser.add_argument("--flower-work", type=float, default=2e7,
                        help="if K*d exceeds this, mask only a few Flower clients and report their mean (default 2e7)")
    args = parser.parse_args()
    max_d = min(args.max_d, 1e4) if args.quick else args.max_d
    repeats = 1 if args.quick else args.repeats
    dims = [d for d in (10**3, 10**4, 10**5, 10**6) if d <= max_d]
    rng = np.random.default_rng(7)
    print("Flower SecAgg+ quantizes to 22 bits (clip [-8, 8], target range 2^22, masks mod 2^32) and returns a\n"
          "stochastically rounded mean; ours sums exact 64-bit fixed point (frac_bits=32, no clipping) mod 2^64.\n"
          "client = one site's whole round (keys + share keys + decrypt shares + encode & mask + unmask reply);\n"
          "server = sum of masked vectors + unmasking. ratio = Flower / ours (> 1: ours faster). "
          f"Median of {repeats}; {args.drop} dropout(s) after ShareKeys.\n")
    print(f"{'K':>4} {'d':>8} {'k':>3} {'t':>3} | {'ours cl ms':>10} {'flwr cl ms':>11} {'ratio':>6} | "
          f"{'ours sv ms':>10} {'flwr sv ms':>11} {'ratio':>6} | note")
    for n_sites in (10, 100):
        graph, t = setting(n_sites)
        k = len(graph[0])
        dropped = set(range(1, 1 + args.drop))
        fl = FlowerSecAggPlus(graph, t, dropped)
        key_runs = [fl.keys_phase() for _ in range(repeats)]  # d-independent; Flower's state ends with the last run
        key_cost = {s: statistics.median(r[s] for r in key_runs) for s in fl.sites}
        for d in dims:
            xs = {s: rng.standard_normal(d) for s in range(n_sites)}
            survivors = sorted(set(range(n_sites)) - dropped)
            ours = [ours_round(xs, graph, t, dropped) for _ in range(repeats)]
            o_cl, o_sv = statistics.median(r[0] for r in ours), statistics.median(r[1] for r in ours)
            exact = sum(FixedPoint(32, n_sites).encode(xs[s]).view(np.int64).astype(object) for s in survivors)
            assert ours[0][2].tolist() == [int(v) * 2.0**-32 for v in exact], "our total is not exact"
            budget = None if n_sites * d <= args.flower_work else 3
            flw = [flower_point(fl, key_cost, xs, budget) for _ in range(repeats)]
            f_cl, f_sv = statistics.median(r[0] for r in flw), statistics.median(r[1] for r in flw)
            note = ""
            if flw[0][2] is not None:
                err = np.max(np.abs(flw[0][2] - np.mean([np.clip(xs[s], -8, 8) for s in survivors], axis=0)))
                note = f"flower mean max err {err:.1e}"
            else:
                note = f"* flower client: mean of {flw[0][3]} of {len(survivors)} clients masked"
            print(f"{n_sites:>4} {d:>8.0e} {k:>3} {t:>3} | {1e3 * o_cl:>10.2f} {1e3 * f_cl:>11.2f} {f_cl / o_cl:>6.1f} | "
                  f"{1e3 * o_sv:>10.2f} {1e3 * f_sv:>11.2f} {f_sv / o_sv:>6.1f} | {note}", flush=True)


if __name__ == "__main__":
    main()
