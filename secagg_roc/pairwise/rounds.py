"""The pairwise-masking phases around one round of an embedded federation.

`LocalFederation` with ``scheme="pairwise"`` hands each secure-sum round to a
`PairwiseRounds`: before the sites answer, the sites of the round advertise
keys and share their seeds through the server (aggregator 0); each site's
`Site` then masks its output with its own `PairwiseClient` (its session for
the round); the server adds the masked vectors as any aggregator does; at the
close it asks the survivors for the shares that remove the remaining masks
and releases the survivors' total. Every message is recorded in the
receiver's transcript (with its encoded size); ``wire=True`` also sends it
through its byte encoding. Per-site (DP) rounds have no masks and skip all
of this.

A deployment runs the same steps across processes: `plan_round` (every
party's view of a round), `note_contributors` and `check_survivors` serve
the deployed server (`deploy.pairwise_relay`) and sites (`deploy.site_pairwise`)
as they serve `PairwiseRounds` here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping


from ..errors import RoundError
from ..messages import AggregateShare, Query, RoundId
from ..transcript import Transcript
from .engine import PairwiseClient
from .server import PairwiseServer
from .graph import Graph, complete_graph, default_degree, neighbour_graph
from .messages import PairwiseMessage, UnmaskRequest, decode

#: Up to this many sites a round uses the complete graph; beyond, SecAgg+'s sparse one.
COMPLETE_UP_TO = 16

#: The phases a site may drop out before (`LocalFederation.take_down`): never asked, after advertising its
#: keys, after sharing them (so it sends no masked input), after its masked input (no unmask response).
SITE_PHASES = ("open", "keys", "share", "unmask")


def round_tag(round_id: RoundId) -> bytes:
    """The engine's round id for a study round: binds every key, mask and share to it."""
    return f"{round_id.study}/{round_id.number}/{round_id.query}".encode()


def plan_round(query: Query, names: Iterable[str], index: Mapping[str, int], threshold_for: Callable[[int], int]
               ) -> tuple[bytes, dict[int, str], Graph, int]:
    """The public parameters of one round among `names`: (tag, site id -> name, neighbour graph, threshold).

    Run by the server and by every Site alike (each recomputes them from the query and the round's sites,
    so no party has to trust another's): the complete graph up to `COMPLETE_UP_TO` sites, beyond it
    SecAgg+'s sparse graph seeded by the round; `threshold_for` the scheme's rule."""
    tag = round_tag(query.round_id)
    ids = {index[n]: n for n in names}
    graph = (complete_graph(ids) if len(ids) <= COMPLETE_UP_TO
             else neighbour_graph(ids, default_degree(len(ids)), seed=tag))
    hood = min(len(n) for n in graph.values()) + 1  # the smallest neighbourhood, the site itself included
    t = threshold_for(len(ids) if len(ids) <= COMPLETE_UP_TO else hood)
    if t > hood:
        raise RoundError(f"{query.round_id}: a pairwise-masking threshold of {t} sites is more than the "
                         f"{hood} sites of the smallest neighbourhood in this round")
    return tag, ids, graph, t


def note_contributors(server: PairwiseServer, index: Mapping[str, int], contributors: Iterable[str],
                      held: Iterable[str]) -> None:
    """Run by the server before the close: of the `held` sites (whose masked vector the round accepted),
    the `contributors` are the survivors; a site left out counts as dropped (its self mask stays on)."""
    held = set(held)
    for site in contributors:
        if site in held:
            server.note_masked(index[site])


def check_survivors(query: Query, request: UnmaskRequest, index: Mapping[str, int],
                    contributors: Iterable[str]) -> set[str]:
    """Run by the server: the survivors' names, which must be exactly the contributor set released over."""
    survivors = {n for n, i in index.items() if i in request.survivors}
    if survivors != set(contributors):
        raise RoundError(f"{query.round_id}: pairwise masks cancel only over every site that sent a masked "
                         f"input; the contributor set {sorted(contributors)} differs from {sorted(survivors)}")
    return survivors


class PairwiseRounds:
    """Run by the server of an embedded federation, with each site's part run on that site's behalf."""

    def __init__(self, sites: tuple[str, ...], server_name: str, threshold_for: Callable[[int], int],
                 transcripts: Mapping[str, Transcript], wire: bool):
        self.index = {name: i for i, name in enumerate(sorted(sites))}
        self.server_name = server_name
        self.threshold_for = threshold_for
        self.transcripts = transcripts
        self.wire = wire
        self._servers: dict[int, PairwiseServer] = {}
        self._clients: dict[int, dict[str, PairwiseClient]] = {}
        self._sessions: dict[int, Mapping[str, dict[int, object]]] = {}
        self._masked: dict[int, set[str]] = {}

    def _send(self, sender: str, receiver: str, message: PairwiseMessage) -> PairwiseMessage:
        if self.wire:
            message = decode(message.encode())
        if self.transcripts:
            self.transcripts[receiver].record(sender, message, message.nbytes())
        return message

    def setup(self, query: Query, names: list[str], sessions: Mapping[str, dict[int, object]],
              down: Mapping[str, str]) -> None:
        """Phases AdvertiseKeys and ShareKeys among `names`; each site's client goes into its `sessions`."""
        number = query.round_id.number
        tag, ids, graph, t = plan_round(query, names, self.index, self.threshold_for)
        server = self._servers[number] = PairwiseServer(tag, ids, t, graph)
        self._sessions[number] = sessions
        clients = self._clients[number] = {}
        for i, name in ids.items():
            if down.get(name) != "open":
                clients[name] = PairwiseClient(i, tag, t, graph[i])
                server.receive_keys(self._send(name, self.server_name, clients[name].advertise_keys()))
        for name, client in clients.items():
            if down.get(name) != "keys":
                keys = self._send(self.server_name, name, server.keys_for(self.index[name]))
                server.route([self._send(name, self.server_name, e) for e in client.share_keys(keys)])
        for name, client in clients.items():
            if down.get(name) not in ("keys", "open"):
                inbox = [self._send(self.server_name, name, e) for e in server.shares_for(self.index[name])]
                client.receive_shares(inbox)
                sessions[name][number] = client

    def masked(self, query: Query, site: str) -> None:
        """Run by the server: a site's masked vector was accepted by the round (which sums it)."""
        if query.round_id.number in self._servers:
            self._masked.setdefault(query.round_id.number, set()).add(site)

    def feed(self, query: Query, contributors: tuple[str, ...]) -> None:
        """Run by the server before the close: which contributors sent a masked vector. The round sums the
        vectors (and names sites whose layout differs from the others', whichever came first)."""
        number = query.round_id.number
        server, held = self._servers.get(number), self._masked.get(number, set())
        if server is None:
            return
        note_contributors(server, self.index, contributors, held)

    def unmask(self, query: Query, contributors: tuple[str, ...], share: AggregateShare,
               down: Mapping[str, str]) -> AggregateShare:
        """Phase Unmasking: the survivors reveal what removes the remaining masks; the release is their total."""
        number = query.round_id.number
        server = self._servers[number]
        request = server.unmask_request()
        survivors = check_survivors(query, request, self.index, contributors)
        for name in sorted(survivors):
            if down.get(name) != "unmask":
                req = self._send(self.server_name, name, request)
                reply = self._clients[number][name].unmask(req)
                server.receive_unmask(self._send(name, self.server_name, reply))
        return dataclasses.replace(share, vector=server.total(share.vector))

    def discard(self, number: int) -> None:
        """Forget a finished or failed round's keys and sums."""
        self._servers.pop(number, None)
        self._clients.pop(number, None)
        self._masked.pop(number, None)
        for held in self._sessions.pop(number, {}).values():
            held.pop(number, None)  # a session a site never used (it refused or left) dies with its round
