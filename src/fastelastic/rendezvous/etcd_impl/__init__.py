"""The etcd v3 side of the fast rendezvous (backend ``etcd``) and of ``etcd-v2``: a store-shaped
client and the liveness of a round's members. Logger names: ``fastelastic.rendezvous.etcd_kv``
and ``fastelastic.rendezvous.etcd_rendezvous``.

- ``etcd_kv``: :class:`EtcdKV`, the TCPStore subset the round machine uses, on etcd. A retried
  read-modify-write is applied once (its operation key); a wait is a watch from the revision
  of the read that found its keys missing, so nothing is missed and nothing polled.
- ``etcd_liveness``: a round's members learn at once that one of them died, through the
  workers' store of rank 0; nothing is revoked when a connection ends on purpose.
- ``etcd_stream``: plumbing under ``etcd_kv``: an unanswered request, a member's URL, one
  watch stream read by its own thread.

A request's flow: ``etcd_rendezvous``'s handler runs the fast rendezvous's machine; each store
request goes to ``EtcdKV``, which sends it to one etcd member through ``etcd3gw`` and fails
over to the next member when it gets no answer.
"""
