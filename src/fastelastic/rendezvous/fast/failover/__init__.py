"""The failover: the rendezvous store outlives its host when ``--rdzv-endpoint`` names several
candidates. Its logger is ``fastelastic.rendezvous.fast_rendezvous.failover``.

- ``_hops``: every move as a typed operation (a start's connect, move, go back, regroup,
  follow, a fenced mover's drop, the proof that lost members are gone, a mover's mark): the
  policy alone, no I/O, run by ``_failover`` on real stores and by the tests' simulation.
- ``_failover``: :class:`Candidates`, the candidate stores (a standby hosted on this node's
  own) and the runner of ``_hops``' operations on them; the live store is the reachable one
  with the highest committed epoch.
- ``_moves``: the handler's moves, one at a time under its move lock, and only when the
  failure came from the store the handler still talks through.
- ``_majority``: the two majority rules (where the last world formed, and on a successor),
  which keep two sides of a partition from both training; used by the round machine.

A request's flow: the handler's store fails as a connection error; ``_moves`` runs
``_hops.move`` (or ``after``) through ``Candidates.run``, which answers each of its requests on
the candidate it names (a probe within ``PROBE_S``) and throws a connection error back into
it; the operation returns the new ``LiveStore`` store, where the node joins again, and the round
there forms only as ``_majority`` allows.
"""
