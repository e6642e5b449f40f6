"""Starts real etcd members on free loopback ports in a temp dir (for the etcd tests)."""

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

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

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

    def __init__(self, tmp: Path, size: int = 1, tls: tuple[str, str, str] | None = None):
        ports = free_ports(2 * size)
        self.members = [Member(f"m{i}", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
        self.tmp = tmp
        self.tls = tls

    def start(self, timeout: float = 30.0) -> Cluster:
        scheme = "https" if self.tls else "http"
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for m in self.members:
            cmd = [ETCD, "--name", m.name, "--data-dir", str(self.tmp / m.name),
                   "--listen-client-urls", f"{scheme}://127.0.0.1:{m.client_port}",
                   "--advertise-client-urls", f"{scheme}://127.0.0.1:{m.client_port}",
                   "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--heartbeat-interval", "50", "--election-timeout", "500",
                   "--logger", "zap", "--log-outputs", "stderr"]
            if self.tls:
                ca, cert, key = self.tls
                cmd += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                        "--client-cert-auth"]
            m.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
        for m in self.members:
            self._await_ready(m, timeout)
        return self

    @staticmethod
    def _await_ready(m: Member, timeout: float) -> None:
        """Reads the member's log (in a thread, so etcd never blocks on a full pipe) until it
        says it serves clients; bounded by ``timeout``."""
        assert m.proc is not None and m.proc.stderr is not None
        ready = threading.Event()
        stream = m.proc.stderr

        def drain() -> None:
            for line in stream:
                if len(m.log) < 2000:
                    m.log.append(line)
                if "serving client traffic" in line or "ready to serve client" in line:
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout):
            raise RuntimeError(f"etcd member {m.name} did not become ready:\n"
                               + "".join(m.log[-20:]))

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

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
