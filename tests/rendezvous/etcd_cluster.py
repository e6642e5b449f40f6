"""Starts real etcd members in a temp dir (for the etcd tests): on free loopback ports, or one
per simulated host (``hosts`` and ``spawn``, e.g. network namespaces of tests/recovery)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    cmd: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def kill(self) -> None:
        """SIGKILL (no leadership transfer, no goodbye to the peers)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """An etcd cluster of ``size`` members; ``tls`` = (ca, cert, key) serves https with
    client-certificate authentication."""

    def __init__(self, tmp: Path, size: int = 1, tls: tuple[str, str, str] | None = None,
                 hosts: list[str] | None = None, spawn=None, timing: tuple[int, int] = (50, 500)):
        """``hosts``: each member's address (ports 2379/2380 then), ``spawn(i, argv, **popen)``
        starts member ``i`` there; ``timing``: heartbeat and election timeouts in ms
        (etcd's defaults: 100, 1000)."""
        if hosts is None:
            ports = free_ports(2 * size)
            self.members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1])
                            for i in range(size)]
        else:
            self.members = [Member(f"m{i}", 2379, 2380, host=hosts[i]) for i in range(size)]
        self.tmp = tmp
        self.tls = tls
        self.timing = timing
        self._spawn = spawn
        self._leader: Member | None = None
        self._lock = threading.Lock()

    def start(self, timeout: float = 30.0) -> Cluster:
        scheme = "https" if self.tls else "http"
        initial = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}" for m in self.members)
        for i, m in enumerate(self.members):
            cmd = [ETCD, "--name", m.name, "--data-dir", str(self.tmp / m.name),
                   "--listen-client-urls", f"{scheme}://{m.host}:{m.client_port}",
                   "--advertise-client-urls", f"{scheme}://{m.host}:{m.client_port}",
                   "--listen-peer-urls", f"http://{m.host}:{m.peer_port}",
                   "--initial-advertise-peer-urls", f"http://{m.host}:{m.peer_port}",
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--heartbeat-interval", str(self.timing[0]),
                   "--election-timeout", str(self.timing[1]),
                   "--logger", "zap", "--log-outputs", "stderr"]
            if self.tls:
                ca, cert, key = self.tls
                cmd += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                        "--client-cert-auth"]
            m.cmd = cmd
            self._launch(i, m)
        for m in self.members:
            self._await_ready(m, timeout)
        return self

    def _launch(self, i: int, m: Member) -> None:
        spawn = self._spawn or (lambda i, argv, **kw: subprocess.Popen(argv, **kw))
        m.proc = spawn(i, m.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def restart(self, m: Member, timeout: float = 30.0) -> None:
        """Starts a stopped member again on its data (it rejoins the cluster)."""
        assert m.proc is not None and m.proc.poll() is not None
        self._launch(self.members.index(m), m)
        self._await_ready(m, timeout)

    def _await_ready(self, m: Member, timeout: float) -> None:
        """Reads the member's log (in a thread, so etcd never blocks on a full pipe) until it
        says it serves clients; bounded by ``timeout``. Notes who says it became leader."""
        assert m.proc is not None and m.proc.stderr is not None
        ready = threading.Event()
        stream = m.proc.stderr

        def drain() -> None:
            for raw in stream:
                line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                if len(m.log) < 2000:
                    m.log.append(line)
                if "became leader" in line:
                    with self._lock:
                        self._leader = m
                if "serving client traffic" in line or "ready to serve client" in line:
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout):
            raise RuntimeError(f"etcd member {m.name} did not become ready:\n"
                               + "".join(m.log[-20:]))

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def logged_leader(self, timeout: float = 30.0) -> Member:
        """The live member that most recently logged it became leader (no request needed:
        works where the members cannot be reached from here)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                m = self._leader
            if m is not None and m.proc is not None and m.proc.poll() is None:
                return m
            if time.monotonic() >= deadline:
                raise RuntimeError("no live etcd member logged that it became leader")
            time.sleep(0.02)

    def leader(self) -> Member:
        import etcd3gw

        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            status = etcd3gw.client(host="127.0.0.1", port=m.client_port).status()
            leader_id = int(status["leader"])
            for cand in self.members:
                if cand.proc is None or cand.proc.poll() is not None:
                    continue
                st = etcd3gw.client(host="127.0.0.1", port=cand.client_port).status()
                if int(st["header"]["member_id"]) == leader_id:
                    return cand
        raise RuntimeError("no etcd leader found")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def make_tls(tmp: Path) -> tuple[str, str, str, str, str]:
    """Self-signed CA, a server cert for 127.0.0.1 and a client cert; returns file paths
    (ca, server_cert, server_key, client_cert, client_key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("fe-test-ca")).issuer_name(name("fe-test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                    critical=False)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return cert, key

    files = []

    def write(obj, fname: str, is_key: bool = False) -> None:
        path = tmp / fname
        if is_key:
            data = obj.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption())
        else:
            data = obj.public_bytes(serialization.Encoding.PEM)
        path.write_bytes(data)
        files.append(str(path))

    write(ca, "ca.pem")
    s_cert, s_key = leaf("127.0.0.1",
                         [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    write(s_cert, "server.pem")
    write(s_key, "server-key.pem", True)
    c_cert, c_key = leaf("fe-client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    write(c_cert, "client.pem")
    write(c_key, "client-key.pem", True)
    return tuple(files)  # type: ignore[return-value]
