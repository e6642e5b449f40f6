"""The majority rules that keep the two sides of a partition from both training.

With several ``--rdzv-endpoint`` candidates the rendezvous can move: nodes that lose the live
store's host move to the next candidate and form rounds there. A partition can leave the host
alive on one side and the movers on the other, so both sides may try to form a round. Two
rules, one on each side, make that impossible. Let ``W`` be the last complete world (on the
store it formed on) and ``need = len(W) // 2 + 1`` a majority of it.

* **On a successor** (:func:`moved_short`): a node that moved carries ``need`` of its world in
  its record; the first round there forms only with at least that many such carriers.
* **Where W formed** (:func:`away`): when a round re-forms without some members of ``W``, those
  that did not say they quit (preempted) or finished may be alive behind the partition, and may
  have moved. The round forms only while they are fewer than ``need``, so they can never make a
  majority elsewhere. A crash that closes its connection counts as away too: a host frozen
  while the others moved sees their connections close when it wakes, as it would after a crash.

Both sides count members of the same ``W``, so the two sets are disjoint and at most one of them
reaches ``need``. With a single endpoint nothing can move and the second rule is off (torch's
behaviour: any survivors at or above ``min_nodes`` go on).

**A majority lost at once** (a rack): where ``W`` formed, members whose connection closed here
without the word ``moved`` (:func:`proof_candidates`) are proven gone, and count as gone for
good, when every other candidate answers and has no mark of them (``moving``), or refuses the
connection (nothing listens there). A timeout or no route blocks the proof: a cut or powered-off
host may hold a majority behind it. Then the objection names the rule and the way out.
"""

from __future__ import annotations

from . import _schema as sc
from ._requests import Get, GoneElsewhere, MultiGet, Proto

GONE_FOR_GOOD = sc.FOR_GOOD  # ``gone`` reasons of members that are nowhere else


def need(world: int) -> int:
    """A majority of a world of ``world`` members."""
    return world // 2 + 1


def moved_short(records: list[bytes]) -> tuple[int, int] | None:
    """On a successor: ``(carriers, needed)`` when the records hold fewer nodes of a moved
    world than the largest majority any of them carries, else None."""
    quorums = [q for q in map(sc.record_quorum, records) if q]
    if len(quorums) < max(quorums, default=0):
        return len(quorums), max(quorums)
    return None


def away(records: list[bytes], last_round: int, world: int, gone: dict[int, str]) -> list[int]:
    """Ranks of the last complete round (``last_round``, ``world`` members) that are neither
    back in this round's records nor gone for good: those that may be alive elsewhere."""
    back = {sc.record_pref(raw) for raw in records if sc.record_member_of(raw) == last_round}
    return [i for i in range(world) if i not in back and gone.get(i) not in GONE_FOR_GOOD]


def proof_candidates(out: list[int], gone: dict[int, str]) -> list[int]:
    """The ranks of ``out`` that may be proven gone: their connection closed here, and they
    did not say they moved (a cut, a silence or a move blocks any proof)."""
    return [i for i in out if gone.get(i) == "closed"]


def objection(records: list[bytes], last: tuple[int, int] | None, can_move: bool,
              keys: sc.Keys) -> Proto[str]:
    """Why a round with these records must not form ("" if it may), for its publisher.

    Before any round completed on this store (``last`` None): :func:`moved_short`. After one,
    that round's world is the one both sides count (a node that moves here later is a new node
    to it); when the rendezvous ``can_move``, :func:`away` (one read of that round's ``gone``),
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
    gone = sc.parse_gone(bytes((yield Get(lk.gone, None))))
    out = away(records, q, world, gone)
    if len(out) < need(world):
        return ""
    # A member that came back by another store (it moved away and back: a new node here by
    # its record) is in this round, not elsewhere: its address and pid are in the records.
    here = {tuple(raw.split(b"|")[1:3]) for raw in records}
    who = [sc.who_parts(bytes(v)) for v in (yield MultiGet([lk.who(i) for i in out]))]
    out = [i for i, (_, addr, pid) in zip(out, who, strict=True)
           if (addr.encode(), pid.encode()) not in here]
    if len(out) < need(world):
        return ""
    closed = proof_candidates(out, gone)
    blocked = ""
    if len(out) - len(closed) < need(world):  # the proof can decide it: ask the others
        who = [sc.who_parts(bytes(v)) for v in (yield MultiGet([lk.who(i) for i in closed]))]
        blocked = yield GoneElsewhere([f"{addr}|{pid}" for _, addr, pid in who])
        if not blocked:
            return ""
    reason = (f"; their connections closed here, but {blocked}" if blocked else
              "; some did not close their connections here (cut, silent or moved)")
    return (f"ranks {out} of round {q} (a world of {world}) may be alive elsewhere: a "
            f"majority of it, which may form a round on another candidate{reason}")


WAY_OUT = ("This is the majority rule of --rdzv-endpoint with several candidates: it keeps a "
           "partition from training two worlds. If those nodes are gone for good (hosts "
           "powered off), bring their hosts (or the candidates' stores) back so that the "
           "loss can be proven, or restart the job with the nodes that are left.")
