"""Certificates and keys for a local control plane, made with the `openssl` CLI (always present; the
`cryptography` package is not a dependency).

EC P-256 keys: generating one takes milliseconds, so a fresh PKI per cluster costs well under a second.
"""

from __future__ import annotations

import base64
import ipaddress
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

# Service-account issuer the apiserver stamps into projected tokens (what a real cluster uses).
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
CLUSTER_NAME = "weightsync-local"

_CA_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
"""


class PkiError(RuntimeError):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Every file a LocalCluster needs: the CA, the apiserver serving cert, client certs for the admin,
    the controller-manager and the scheduler, and the service-account signing key pair."""

    dir: Path
    ca: CertPair
    apiserver: CertPair
    admin: CertPair
    controller_manager: CertPair
    scheduler: CertPair
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("openssl not found; install it (apt-get install -y openssl)")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def _ec_key(path: Path, cwd: Path) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path), cwd=cwd)


def san_line(dns: list[str], ips: list[str]) -> str:
    """`subjectAltName` value: DNS names then IP addresses (validated)."""
    entries = [f"DNS:{d}" for d in dns] + [f"IP:{ipaddress.ip_address(ip)}" for ip in ips]
    return ",".join(entries)


def _leaf(directory: Path, name: str, subject: str, ca: CertPair, *, server: bool, san: str = "") -> CertPair:
    key, csr, crt, ext = (directory / f"{name}{s}" for s in (".key", ".csr", ".crt", ".ext"))
    _ec_key(key, directory)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr),
             "-config", str(directory / "ca.cnf"), cwd=directory)
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    lines = ["[v3]", "basicConstraints = critical,CA:FALSE",
             "keyUsage = critical,digitalSignature,keyEncipherment", f"extendedKeyUsage = {usage}"]
    if san:
        lines.append(f"subjectAltName = {san}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-set_serial", str(secrets.randbits(63)), "-days", "3650", "-sha256",
             "-extfile", str(ext), "-extensions", "v3", "-out", str(crt), cwd=directory)
    csr.unlink()
    ext.unlink()
    return CertPair(crt, key)


def generate_pki(directory: Path, service_ip: str = "10.96.0.1") -> Pki:
    """Write a fresh CA and every certificate into DIRECTORY (created) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.cnf").write_text(_CA_CONFIG)
    ca = CertPair(directory / "ca.crt", directory / "ca.key")
    _ec_key(ca.key, directory)
    _openssl("req", "-x509", "-new", "-key", str(ca.key), "-subj", f"/CN={CLUSTER_NAME}-ca", "-days", "3650",
             "-sha256", "-config", str(directory / "ca.cnf"), "-extensions", "v3_ca", "-out", str(ca.cert),
             cwd=directory)
    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           "kubernetes.default.svc.cluster.local"]
    apiserver = _leaf(directory, "apiserver", "/CN=kube-apiserver", ca, server=True,
                      san=san_line(dns, ["127.0.0.1", service_ip]))
    admin = _leaf(directory, "admin", "/O=system:masters/CN=weightsync-admin", ca, server=False)
    cm = _leaf(directory, "controller-manager", "/CN=system:kube-controller-manager", ca, server=False)
    sched = _leaf(directory, "scheduler", "/CN=system:kube-scheduler", ca, server=False)
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    _ec_key(sa_key, directory)
    _openssl("ec", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    return Pki(directory, ca, apiserver, admin, cm, sched, sa_key, sa_pub)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def render_kubeconfig(server: str, ca_cert: Path, client: CertPair, user: str = "admin",
                      cluster: str = CLUSTER_NAME) -> str:
    """A self-contained kubeconfig (certificates embedded, so the file can be copied anywhere)."""
    context = f"{user}@{cluster}"
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)}}],
        "users": [{"name": user, "user": {"client-certificate-data": _b64(client.cert),
                                          "client-key-data": _b64(client.key)}}],
        "contexts": [{"name": context, "context": {"cluster": cluster, "user": user, "namespace": "default"}}],
        "current-context": context,
        "preferences": {},
    }
    return yaml.safe_dump(doc, sort_keys=False)
