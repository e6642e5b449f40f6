"""A node's start with several candidates, as typed operations (:mod:`._hops`' requests): it
hosts its standby store (:func:`host_standby`), syncs it (:func:`sync_standby`, again and
again while too few candidates answer: :func:`keep_syncing`), and finds the live store
(:func:`start`). The handler runs them on real stores (``_failover.Candidates``), the tests'
simulation on simulated ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastelastic.errors import RendezvousConnectionError

from .._schema import encode_started, encode_synced
from ._hops import (
    AppendStandby,
    Count,
    FailoverContext,
    FailoverOp,
    HostStandby,
    Pause,
    ReadMoving,
    behind,
    connect,
    may_have_lost_state,
    no_world_yet,
    probe,
    sync_entries,
)

log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.failover")

SYNC_WARN_S = 60.0  # a standby not synced this long says so


@dataclass(frozen=True)
class HostedStandby:
    """The candidate this node hosts; its store's incarnation (empty: it counted at once, a
    job's start); whether it is synced."""

    index: int
    nonce: bytes
    synced: bool


def read_others(p: FailoverContext, skip: int = -1) -> FailoverOp[tuple[tuple[int, int] | None,
                                                      dict[int, bytes | None]]]:
    """(index, epoch) of the answering candidate with the highest committed epoch, if any is
    above 0; each candidate's ``moving`` list (None: no answer) but ``skip``'s. Quick: a
    refused connection answers at once, a silent host gets ``PRE_PROBE_S``."""
    found, _ = yield from probe(p, skip, quick=True)
    best = (found[0][1], -found[0][0]) if found and found[0][0] < 0 else None
    lists: dict[int, bytes | None] = {}
    for j in range(len(p.names)):
        if j != skip:
            lists[j] = yield ReadMoving(j)
    return best, lists


def first_shows_no_world(p: FailoverContext) -> FailoverOp[bool]:
    """Whether the first candidate answers and shows that no world formed yet
    (:func:`._hops.no_world_yet`), read on its last probe's connection."""
    epoch = yield Count(0, p.keys.epoch)
    opened = yield Count(0, p.keys.open)
    moving = yield ReadMoving(0)
    return (epoch is not None and opened is not None and moving is not None
            and no_world_yet(epoch, opened, moving))


def host_standby(p: FailoverContext, mine: list[int]) -> FailoverOp[HostedStandby | None]:
    """Hosts the standby on the first of the candidates ``mine`` (this machine's) that no
    other process hosts, after reading the others (:func:`read_others`). Where it may have
    lost marks or fences (:func:`._hops.may_have_lost_state`) its store starts not counting
    (its first entry) until synced, and is marked ``behind`` a committed epoch elsewhere
    (:func:`._hops.behind`). None when it hosts none."""
    found, lists = yield from read_others(p)
    fresh = yield from first_shows_no_world(p)
    i = yield HostStandby(tuple(mine))
    if i < 0:
        return None
    others = {j: raw for j, raw in lists.items() if j != i}
    if not may_have_lost_state(found is not None, list(others.values()), others.get(0),
                               fresh and i != 0):
        return HostedStandby(i, b"", True)  # a job's start: nothing to copy, it counts at once
    nonce = p.nonce()
    # the store counts toward no quorum from here until its ``s`` entry (sync_standby)
    yield AppendStandby(encode_started(nonce))
    if found is not None:
        yield from behind(p, i, *found)
    synced = yield from sync_standby(p, i, nonce, others)
    return HostedStandby(i, nonce, synced)


def sync_standby(p: FailoverContext, standby: int, nonce: bytes,
                 lists: dict[int, bytes | None] | None = None) -> FailoverOp[bool]:
    """Appends to the standby (candidate ``standby``, incarnation ``nonce``) what
    :func:`._hops.sync_entries` makes of the other candidates' ``lists`` (read now when
    None), with the entry that makes it count; False while too few of them answered."""
    if lists is None:
        _, lists = yield from read_others(p, standby)
    fresh = standby != 0 and (yield from first_shows_no_world(p))
    entries = sync_entries(list(lists.values()), len(p.names), fresh)
    if entries is None:
        return False
    yield AppendStandby(entries + encode_synced(nonce))
    log.debug("candidate %s synced from the others", p.name(standby))
    return True


def keep_syncing(p: FailoverContext, standby: int, nonce: bytes) -> FailoverOp[None]:
    """:func:`sync_standby` every ``sync_retry_s`` until it is done; its host stops it when
    the standby closes (at a job's start the other candidates' hosts start about when this
    one does)."""
    waited = 0.0
    for _ in range(10_000_000):  # until synced or stopped by the host
        yield Pause(p.sync_retry_s)
        waited += p.sync_retry_s
        try:
            if (yield from sync_standby(p, standby, nonce)):
                return
        except RendezvousConnectionError as e:
            log.debug("candidate sync: %s", e)
        if waited >= SYNC_WARN_S > waited - p.sync_retry_s:
            log.warning(
                "the rendezvous candidate %s hosted here has not read the other candidates' "
                "lists after %.0fs: it does not count toward the failover's quorums until it "
                "does (it waits for every other candidate, or a majority of them synced)",
                p.name(standby), waited)


def start(p: FailoverContext, standby: int, at_least: int = 0,
          world: bytes = b"") -> FailoverOp[tuple[int, int, int]]:
    """A node's start: the live store (:func:`._hops.connect`); the standby it hosts (if
    ``standby`` >= 0) marked ``behind`` that store's committed epoch."""
    i, epoch, proposed = yield from connect(p, -1, at_least, world)
    if standby >= 0:
        yield from behind(p, standby, i, epoch)
    return i, epoch, proposed
