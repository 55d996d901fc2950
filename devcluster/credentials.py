"""Credentials of the dev cluster: the admin token file, the service-account signing key, and
kubeconfigs (pure rendering plus writing).

The API server self-signs its serving certificate into its `--cert-dir`; every client trusts
that file (it holds the serving certificate and the CA that signed it).
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kubeinfer.devcluster.config import DevClusterError

ADMIN_USER = "admin"
CLUSTER_NAME = "kubeinfer-dev"


def ensure_token_file(path: Path) -> str:
    """The admin token, from `path` (the API server's --token-auth-file), made on first use."""
    if path.exists():
        return path.read_text().split(",", 1)[0].strip()
    token = secrets.token_hex(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{token},{ADMIN_USER},{ADMIN_USER}-uid,"system:masters"\n')
    path.chmod(0o600)
    return token


def ensure_signing_key(path: Path) -> None:
    """An RSA key that both signs (apiserver, controller-manager) and verifies SA tokens."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["openssl", "genrsa", "-out", str(path), "2048"],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise DevClusterError(
            f"openssl genrsa failed: {exc} {detail.decode(errors='replace')}"
        ) from exc
    path.chmod(0o600)


def render_kubeconfig(
    *, server: str, ca_file: Path, token: str, user: str = ADMIN_USER, namespace: str = "default"
) -> dict[str, Any]:
    """A kubeconfig with one cluster, one user (bearer token) and one current context."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": CLUSTER_NAME,
                "context": {"cluster": CLUSTER_NAME, "user": user, "namespace": namespace},
            }
        ],
        "current-context": CLUSTER_NAME,
        "preferences": {},
    }


def write_kubeconfig(path: Path, kubeconfig: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)
