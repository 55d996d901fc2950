"""Upstream API definitions the dev cluster installs for tests, fetched by module name.

The Gateway API Inference Extension's InferencePool CRD comes from its Go module
(`sigs.k8s.io/gateway-api-inference-extension` at a pinned release) through the Go module
proxy, as the control plane's binaries do (`hack/controlplane/`): `go mod download` into a
module cache of kubeinfer's own (`$KUBEINFER_CACHE/gomod`), reused while present. Nothing
upstream is ever copied into the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from kubeinfer.devcluster.config import DevClusterError

INFERENCE_EXTENSION_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
#: A release that serves inference.networking.k8s.io/v1 (v1.0.0 on), pinned for the tests.
INFERENCE_EXTENSION_VERSION = "v1.6.2"
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
DOWNLOAD_TIMEOUT_S = 600


def _cache() -> Path:
    return Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))


def module_dir(module: str, version: str) -> Path:
    """The module's files (read-only, Go's module cache layout), downloaded once."""
    go = shutil.which("go")
    if go is None:
        raise DevClusterError(f"`go` is needed to fetch {module}@{version} (make controlplane)")
    env = {**os.environ, "GOMODCACHE": str(_cache() / "gomod"), "GOFLAGS": "-mod=mod"}
    done = subprocess.run(
        [go, "mod", "download", "-json", f"{module}@{version}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=DOWNLOAD_TIMEOUT_S,
        check=False,
    )
    try:
        info = json.loads(done.stdout)
    except ValueError:
        info = {}
    if done.returncode != 0 or "Dir" not in info:
        why = info.get("Error") or done.stderr.strip()[-500:]
        raise DevClusterError(f"go mod download {module}@{version} failed: {why}")
    return Path(info["Dir"])


def inference_pool_crd() -> Path:
    """The upstream InferencePool CRD (inference.networking.k8s.io/v1) at the pinned release."""
    path = module_dir(INFERENCE_EXTENSION_MODULE, INFERENCE_EXTENSION_VERSION) / INFERENCE_POOL_CRD
    if not path.is_file():
        raise DevClusterError(f"{path.name} is not in {INFERENCE_EXTENSION_MODULE} any more")
    return path
