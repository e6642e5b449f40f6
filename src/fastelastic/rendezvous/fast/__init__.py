"""The fast rendezvous (backends ``c10d``, ``fastelastic`` and ``etcd``): its handler and its
round machine. Registered in :mod:`..registry`; its logger is
``fastelastic.rendezvous.fast_rendezvous`` (each module here that logs does so under a
child of it).

The handler, which does the I/O:

- ``fast_rendezvous``: :class:`FastRendezvousHandler`, torch's handler API. Runs the machine's
  operations on a store client, one connection per call, and never decides a rule itself.
- ``_worker_store``: each round's rank 0 hosts a fresh, empty store for its workers; a node's
  listening socket is bound before its address is published.
- ``_store_hosting``: hosts or joins the rendezvous store at the endpoint (also c10d-v2's).
- ``_store_ops``: answers the machine's typed requests on a store client; a long wait is cut
  into slices, each answered within the detection window.

The round machine, transport-free (no I/O; an injected clock):

- ``_round``: :class:`Machine`, a node's attempt at a round; roles come from the ticket, so
  nobody races.
- ``_phases``: the phases of an attempt and the one rule between them (no cycle).
- ``_members``: a member's operations between rounds (membership checks, leave, done, close).
- ``_liveness``: keep-alive counters, and the rule that calls a member silent.
- ``_schema``: every key, what it holds, and its codec; a byte format is built and parsed
  here alone (also the values of ``etcd_impl.etcd_liveness``'s link).
- ``_requests``: the closed set of typed requests the machine yields; imports nothing.
- ``_config``: :class:`Config`, what a node's machine is configured with (a leaf).

The failover between ``--rdzv-endpoint`` candidates is in :mod:`.failover`.

A request's flow: ``FastRendezvousHandler.next_rendezvous`` starts ``Machine.join``, a
generator; each typed request it yields (``_requests``, on keys of ``_schema``) is answered
by ``_store_ops.apply`` on the live store and its reply sent back in, until the generator
returns the node's seat. A store that fails as a connection error goes to the failover
(``failover._moves``), which moves the node and starts the join again.
"""
