"""A plain 2-rank script whose end aborts in the interpreter's teardown (issue 35 item 3).

Rank 0 starts an ``all_reduce`` with ``async_op=True`` and drops its handle at once: gloo's
worker thread then holds the last reference to the work and, through it, to the tensor's
Python object. Rank 1 joins that collective only when rank 0's last ``atexit`` handler (the
first registered) tells it over a socket, and answers when its side is done. That handler
makes its libc calls holding the GIL (``ctypes.PyDLL``), with a switch interval that makes no
waiting thread take the GIL from it, and keeps the GIL 0.3 s more, so
rank 0's gloo thread, which has the data then, finishes the work and waits for the GIL to drop
that object (torch's ``decref`` checks ``Py_IsInitialized()``, still true, then takes the
GIL); Python then sets itself finalising with the GIL never given up. Once it gives the GIL
up, the waiting thread sees the interpreter finalising and Python ends it with
``pthread_exit``, whose forced unwind through the work's destructor (``noexcept``) is
``std::terminate``: started directly (``python script.py``), rank 0 dies of SIGABRT. Ended
without the teardown, both ranks exit 0.
"""

import atexit
import ctypes
import socket
import sys

_to_rank_1 = []


@atexit.register  # before torch's own handlers: it runs after them, the last one
def _let_rank_1_in():
    if not _to_rank_1:
        return
    sys.setswitchinterval(1000.0)  # no waiting thread makes this one give the GIL up
    libc, fd, buf = ctypes.PyDLL(None), _to_rank_1[0].fileno(), ctypes.create_string_buffer(1)
    libc.send(fd, b"x", 1, 0)  # PyDLL: the GIL stays held through each call
    libc.recv(fd, buf, 1, 0)  # rank 1's side is done: rank 0 has its data
    libc.usleep(300000)  # the gloo thread finishes the work and waits for the GIL


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import _get_default_store  # noqa: E402

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
store = _get_default_store()
t = torch.ones(1)
if rank == 0:
    sock = socket.create_connection(("127.0.0.1", int(store.get("plain_end_forced/port"))))
    w = dist.all_reduce(t, async_op=True)
    del w  # the gloo thread now holds the work's last reference
    _to_rank_1.append(sock)
else:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        store.set("plain_end_forced/port", str(srv.getsockname()[1]))
        conn, _ = srv.accept()
    conn.settimeout(120)
    assert conn.recv(1) == b"x", "rank 0 ended without letting rank 1 in"
    dist.all_reduce(t)
    conn.sendall(b"x")
print("end of script", rank, flush=True)
