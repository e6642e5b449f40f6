"""The failover: the rendezvous store outlives its host when ``--rdzv-endpoint`` names several
candidates. Its logger is ``fastelastic.rendezvous.fast_rendezvous.failover``.

- ``_hops``: every move as a typed operation (a mover's join loop, move, go back, regroup,
  follow, a fenced mover's drop, the proof that lost members are gone, a mover's mark): the
  policy alone, no I/O, run by ``_failover`` on real stores and by the tests' simulation.
  Keeps: a proof and a mark count only from quorums that meet, and a node with no world never
  moves the rendezvous.
- ``_start``: a node's start as typed operations (its standby hosted and synced, the live
  store found). Keeps: a restarted standby counts toward no quorum until it copied the others.
- ``_failover``: :class:`Candidates`, the candidate stores (a standby hosted on this node's
  own) and the runner of those operations on them; the live store is the reachable one with
  the highest committed epoch.
- ``_moves``: the handler's side of the operations: its joins and moves, one at a time under
  its move lock, and only when the failure came from the store the handler still talks
  through.
- ``_majority``: the two majority rules (where the last world formed, and on a successor),
  which keep two sides of a partition from both training; used by the round machine.

A request's flow: the handler's join runs ``_hops.join_anywhere`` through ``Candidates.run``,
which answers each request on the candidate it names (a probe within ``PROBE_S``) or on the
handler (``JoinRound``, the machine's store requests), and throws a connection error back
into it; on a failure the operation moves (``after``), adopts the new ``LiveStore`` and joins
again there, and the round there forms only as ``_majority`` allows.
"""
