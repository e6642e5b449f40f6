"""etcd plumbing under :mod:`.etcd_kv`: a request that got no answer, a member's URL, and one
watch stream read by its own thread."""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

__all__ = ["CONNECT_S", "Unanswered", "WatchStream", "member_url"]

CONNECT_S = 2.0  # connect timeout of every request and stream


class Unanswered(Exception):
    """A request got no answer from its member (down, unreachable, or without a leader)."""


def _own_session(shared: Any) -> Any:
    """A new session with ``shared``'s TLS, auth and environment settings."""
    import requests

    own = requests.Session()
    own.verify = shared.verify
    own.cert = shared.cert
    own.trust_env = shared.trust_env
    own.auth = shared.auth
    own.headers.update(shared.headers)
    return own


def member_url(client: Any, path: str) -> str:
    """The member's URL of ``path`` (the first call asks the member its API version)."""
    from etcd3gw import exceptions as etcd_exc

    try:
        return str(client.get_url(path))
    except etcd_exc.Etcd3Exception as e:
        raise Unanswered(getattr(e, "detail_text", None) or str(e) or type(e).__name__) from e


class WatchStream:
    """One etcd watch (the gateway's streamed ``POST /watch``), read by its own daemon thread.

    ``on_event(event)`` runs in that thread for each event (keys and values still base64);
    ``on_end()`` runs once when the stream ends, whatever the reason (member gone, stopped,
    canceled). ``last_rev`` is the revision of the last event delivered.
    """

    def __init__(self, client: Any, body: dict, start_rev: int, on_event: Any, on_end: Any
                 ) -> None:
        import requests

        self.client = client
        self.last_rev = start_rev - 1
        self.error: str | None = None
        self._stopped = False
        self._on_event = on_event
        self._on_end = on_end
        body = dict(body, start_revision=start_rev)
        # A session of its own: the stream's connection never returns to the shared pool, so
        # stop()'s shutdown and close can never reach a request of another thread that reused it.
        self._session = _own_session(client.session)
        try:
            self._resp = self._session.post(member_url(client, "/watch"),
                                            json={"create_request": body}, stream=True,
                                            timeout=(CONNECT_S, None))
        except requests.exceptions.RequestException as e:
            self._session.close()
            raise Unanswered(str(e)) from e
        if self._resp.status_code != 200:
            text = self._resp.text[:200]
            self._resp.close()
            self._session.close()
            raise Unanswered(f"watch: HTTP {self._resp.status_code}: {text}")
        self._thread = threading.Thread(target=self._read, name="fe-etcd-watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._resp.iter_lines(chunk_size=None):
                if not line.strip():
                    continue
                msg = json.loads(line)
                res = msg.get("result")
                if res is None:
                    self.error = str(msg.get("error", msg))[:200]
                    break
                if res.get("canceled"):
                    self.error = f"canceled: {res.get('cancel_reason', '')} " \
                                 f"(compacted at {res.get('compact_revision', '?')})"
                    break
                for ev in res.get("events") or []:
                    self._on_event(ev)
                    self.last_rev = max(self.last_rev, int(ev["kv"].get("mod_revision", 0)))
        except Exception as e:  # noqa: BLE001 - the stream's end is what matters, and why
            if not self._stopped:
                self.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            self._on_end()

    def stop(self) -> None:
        """Ends the stream: its reader thread returns (it is not waited for)."""
        self._stopped = True
        raw = getattr(getattr(self._resp, "raw", None), "_fp", None)
        try:  # a recv blocked in the reader thread returns only once the socket is shut down
            fd = raw.fileno() if raw is not None else -1
            if fd >= 0:
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.close()
        except (OSError, ValueError, AttributeError):
            pass
        self._resp.close()
        self._session.close()
