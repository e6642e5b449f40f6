"""The majority rules that keep the two sides of a partition from both training.

With several ``--rdzv-endpoint`` candidates the rendezvous can move: nodes that lose the live
store's host move to the next candidate and form rounds there. A partition can leave the host
alive on one side and the movers on the other, so both sides may try to form a round. Two
rules, one on each side, make that impossible. Let ``W`` be the last complete world (on the
store it formed on) and ``need = len(W) // 2 + 1`` a majority of it.

* **On a successor** (:func:`moved_short`): a node that moved carries its world in its record
  (the world's id and ``need``); the first round there forms only with at least ``need``
  carriers of the newest world any record carries. A node carries only the last world it was
  a member of, so carriers of an older world ``V`` are the members of ``V`` that no later
  world took in: on ``V``'s store the next world formed with fewer than ``need(V)`` of them
  away, and elsewhere with ``need(V)`` of them, who carry the new world from then on; either
  way fewer than ``need(V)`` are left, and counted with the newest world's carriers they
  could make a majority that no world has (two cuts in a row).
* **A node that carries no world never moves the rendezvous** (``fast_rendezvous``): cut
  during its first join, it cannot know whether a world formed with it or without it, so no
  rule could hold it; it follows only committed epochs, or waits for the store it was on.
* **Where W formed** (:func:`away`): when a round re-forms without some members of ``W``, those
  that did not say they quit (preempted) or finished may be alive behind the partition, and may
  have moved. The round forms only while they are fewer than ``need``, so they can never make a
  majority elsewhere. A crash that closes its connection counts as away too: a host frozen
  while the others moved sees their connections close when it wakes, as it would after a crash.

Both sides count members of the same ``W``, so the two sets are disjoint and at most one of them
reaches ``need``: the carriers are among the members away from the world that formed on ``W``'s
store, which are fewer than ``need``, or they formed the successor's world and no longer carry
``W``. With a single endpoint nothing can move and the second rule is off (torch's
behaviour: any survivors at or above ``min_nodes`` go on).

**A majority lost at once** (a rack): where ``W`` formed, members whose connection closed here
without the word ``moved`` (:func:`proof_candidates`) are proven gone, and count as gone for
good, when the proof (``_hops.prove_gone``) reads its fences of them back from a majority of
the candidates with no mark of them before a fence, and no mark here proposing an epoch above
this store's says one of them moved back (:func:`_back_here`).

**The quorums.** With ``n`` candidates, a proof's fences count once read back from ``n//2 + 1``
of them, a mover's mark once read back from ``n - (n//2 + 1) + 1``; the two add up to more
than ``n``, so they share a candidate, whose atomic appends order the mark and the fence for
both readers: a mark first blocks the proof, a fence first makes its mover drop ``W`` there
(``_hops.Fenced``; no rule counts it for ``W`` again). No bound on anyone's delay is needed.

- Assumes: no failure domain holds half the candidates, and at most one candidate's store
  restarts while marks are only on it (a restarted store counts once its host copied the
  others' lists, ``_hops.sync_entries``).
- Refusals and timeouts prove nothing: a candidate that refuses (a REJECT rule, a reset, a
  pod not listening yet) or does not answer is no answer, as is a store not synced yet.
- Costs: when a majority of the world and half the candidates or more are lost together, the
  rest wait until those candidates answer again, or the job is restarted (:data:`WAY_OUT`).

A proof that fails after fencing withdraws its own fences (``y<W's id>/<proof>|...``), so a
mover that comes later carries ``W`` all the same; a withdrawal that does not get through costs
at most that mover's vote.
"""

from __future__ import annotations

from .. import _schema as sc
from .._requests import Add, Check, Get, GoneElsewhere, MultiGet, RequestGen

GONE_FOR_GOOD = sc.FOR_GOOD  # ``gone`` reasons of members that are nowhere else


def need(world: int) -> int:
    """A majority of a world of ``world`` members."""
    return world // 2 + 1


def moved_short(records: list[bytes]) -> tuple[int, int] | None:
    """On a successor: ``(carriers, needed)`` when the records hold fewer carriers of the
    newest moved world (the highest generation any record names) than a majority of it, else
    None. Carriers of older worlds count as new nodes, however many: they cannot make that
    majority (see the module doc), and counted together with it they could."""
    carried = [(sc.world_gen(w), w, q) for w, q in
               ((sc.record_world(r), sc.record_quorum(r)) for r in records) if q]
    if not carried:
        return None
    gen = max(g for g, _, _ in carried)
    best = (0, 0)
    for wid in sorted({w for g, w, _ in carried if g == gen}):
        of = [q for _, w, q in carried if w == wid]
        if len(of) >= max(of):
            return None
        best = max(best, (len(of), max(of)))
    return best


def away(records: list[bytes], last_round: int, world: int, gone: dict[int, str]) -> list[int]:
    """Ranks of the last complete round (``last_round``, ``world`` members) that are neither
    back in this round's records nor gone for good: those that may be alive elsewhere."""
    back = {sc.record_pref(raw) for raw in records if sc.record_member_of(raw) == last_round}
    return [i for i in range(world) if i not in back and gone.get(i) not in GONE_FOR_GOOD]


def proof_candidates(out: list[int], raw_gone: bytes, tickets: dict[int, str]) -> list[int]:
    """The ranks of ``out`` that may be proven gone: their connection closed here (first
    reason or not: a member that left to re-join and died while it did is as gone as one
    that died training; one that died before it read its seat is known by its ticket,
    ``tickets`` rank -> ticket), and they never said they moved (a cut, a silence or a move
    blocks any proof)."""
    closed = sc.closed_unmoved(raw_gone, tickets)
    return [i for i in out if i in closed]


def objection(records: list[bytes], last: tuple[int, int] | None, can_move: bool,
              keys: sc.RunKeys, last_gen: int = 0) -> RequestGen[str]:
    """Why a round with these records must not form ("" if it may), for its publisher.

    Before any round completed on this store (``last`` None): :func:`moved_short`. After one,
    that round's world is the one both sides count (a node that moves here later is a new node
    to it), unless movers here carry a world of a higher generation than that round's
    (``last_gen``: formed elsewhere from it, or after it): then :func:`moved_short` over
    those carriers, and with a majority of that newer world here the round may form (the
    older world's rule no longer applies). When the rendezvous ``can_move``,
    :func:`away` (one read of that round's ``gone``),
    then, if a majority is away, the proof that those whose connection closed are gone (their
    ``who`` entries, then ``gone_elsewhere``: every other candidate asked, see the module doc).
    """
    if last is None:
        short = moved_short(records)
        return "%d of a moved world need %d of it" % short if short else ""
    if not can_move:
        return ""
    q, world = last
    lk = keys.round(q)
    newer = [r for r in records if sc.world_gen(sc.record_world(r)) > last_gen]
    short = moved_short(newer)
    if short:  # a world formed elsewhere after this store's last: its majority rules
        return "%d of a moved world need %d of it" % short
    if any(map(sc.record_quorum, newer)):
        # A majority of that newer world is here: it descends from this store's last world,
        # whose majority formed it or let it form, so that older world's members away can
        # make no majority elsewhere (its rule would block every round here)
        return ""
    raw_gone = bytes((yield Get(lk.gone, None)))
    gone = sc.parse_gone(raw_gone)
    out = away(records, q, world, gone)
    if len(out) < need(world):
        return ""
    # A member that came back by another store (it moved away and back: a new node here by
    # its record) is in this round, not elsewhere: its identity is in the records. Only the
    # identity (unique per launcher, sc.node_id) says so: pods share address and pid.
    here = {sc.record_node(raw) for raw in records}
    raw_who = [bytes(v) for v in (yield MultiGet([lk.who(i) for i in out]))]
    tickets = {i: sc.who_parts(raw)[0] for i, raw in zip(out, raw_who, strict=True)}
    nodes = {i: sc.who_node(raw) for i, raw in zip(out, raw_who, strict=True)}
    out = [i for i in out if nodes[i] not in here]
    if len(out) < need(world):
        return ""
    closed = proof_candidates(out, raw_gone, tickets)
    blocked = ""
    if len(out) - len(closed) < need(world):  # the proof can decide it: ask the others
        idents = [nodes[i] for i in closed]
        blocked = yield from _back_here(idents, keys)
        if not blocked:  # fenced in the world's name: its movers read the same fence
            wid = sc.parse_outcome(bytes((yield Get(lk.outcome, None)))).wid
            blocked = yield GoneElsewhere(idents, wid)
        if not blocked:
            return ""
    reason = (f"; their connections closed here, but {blocked}" if blocked else
              "; some did not close their connections here (cut, silent or moved)")
    return (f"ranks {out} of round {q} (a world of {world}) may be alive elsewhere: a "
            f"majority of it, which may form a round on another candidate{reason}")


def _back_here(idents: list[str], keys: sc.RunKeys) -> RequestGen[str]:
    """Which of ``idents`` moved (back) to this very store, their move not committed: a mark
    here proposing an epoch above this store's. They are not gone: one that carries a world
    formed elsewhere may be all that is left of it, and a world formed here without it would
    leave it blocking every later round. "" when none."""
    if not (yield Check([keys.moving])):
        return ""
    marks = bytes((yield Get(keys.moving, None)))
    epoch = int((yield Add(keys.epoch, 0)))
    here = {ident for proposed, ident in sc.marks(marks) if proposed > epoch}
    back = [x for x in idents if x in here]
    return f"{back} moved back here, their move not committed" if back else ""


WAY_OUT = ("This is the majority rule of --rdzv-endpoint with several candidates: it keeps a "
           "partition from training two worlds, and a proof that members are gone needs a "
           "majority of the candidates to answer (no failure domain may hold half the "
           "candidates). If those nodes are gone for good (hosts powered off), bring their "
           "hosts (or the candidates' stores, at the same addresses) back so that the loss can "
           "be proven, or restart the job with the nodes that are left.")
