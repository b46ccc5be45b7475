"""Keys, certificates, tokens and kubeconfigs for the local control plane.

Certificates come from the `openssl` command (part of the base system), so the
harness needs no extra Python dependency. Keys are ECDSA P-256: fast to make,
and accepted by kube-apiserver for serving and service-account signing.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

# Names the apiserver's serving certificate answers to. Only loopback is ever dialled.
APISERVER_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path  # signs service-account tokens
    sa_pub: Path  # verifies them


@dataclass(frozen=True)
class Identity:
    """One static token user of the apiserver."""

    user: str
    token: str
    groups: tuple[str, ...]


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the `openssl` command is needed to make the cluster's certificates")
    proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def make_pki(directory: Path) -> Pki:
    """A CA, an apiserver serving certificate it signs, and a service-account key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", pki.ca_key.name, "-out", pki.ca_cert.name,
        "-days", "3650", "-subj", "/CN=pdcluster-e2e-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-new", *ec, "-keyout", pki.serving_key.name, "-out", "apiserver.csr",
        "-subj", "/CN=kube-apiserver",
        cwd=directory,
    )  # fmt: skip
    extensions = directory / "apiserver.ext"
    extensions.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(APISERVER_SANS)}\n"
    )
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", pki.ca_cert.name,
        "-CAkey", pki.ca_key.name, "-CAcreateserial", "-out", pki.serving_cert.name,
        "-days", "3650", "-extfile", extensions.name,
        cwd=directory,
    )  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki.sa_key.name,
             cwd=directory)  # fmt: skip
    _openssl("ec", "-in", pki.sa_key.name, "-pubout", "-out", pki.sa_pub.name, cwd=directory)
    for key in (pki.ca_key, pki.serving_key, pki.sa_key):
        key.chmod(0o600)
    return pki


def make_self_signed(directory: Path, name: str, sans: list[str]) -> tuple[Path, Path]:
    """A self-signed serving certificate and key (for endpoints nobody verifies, such as
    the node agent's kubelet port: the apiserver skips kubelet verification unless told)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key.name, "-out", cert.name, "-days", "3650", "-subj", f"/CN={name}",
        "-addext", f"subjectAltName={','.join(sans)}",
        cwd=directory,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


def make_identities() -> dict[str, Identity]:
    """Fresh random tokens: the admin, the two controllers and the node agent."""

    def new(user: str, *groups: str) -> Identity:
        return Identity(user, secrets.token_hex(24), groups)

    return {
        "admin": new("pdcluster-admin", "system:masters"),
        "controller-manager": new("system:kube-controller-manager"),
        "scheduler": new("system:kube-scheduler"),
        # One agent speaks for every fake node, so it cannot be a single system:node:<name>.
        "node-agent": new("pdcluster-node-agent", "system:masters"),
    }


def render_token_file(identities: dict[str, Identity]) -> str:
    """kube-apiserver --token-auth-file format: token,user,uid,"group1,group2"."""
    lines = []
    for identity in identities.values():
        groups = ",".join(identity.groups)
        lines.append(f'{identity.token},{identity.user},{identity.user},"{groups}"')
    return "\n".join(lines) + "\n"


def render_kubeconfig(server: str, ca_cert: Path, user: str, token: str) -> str:
    """A kubeconfig with one cluster, user and context, all named `pdcluster-e2e`."""
    name = "pdcluster-e2e"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority": str(ca_cert)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user}}],
        "current-context": name,
        "preferences": {},
    }
    return yaml.safe_dump(config, sort_keys=False)
