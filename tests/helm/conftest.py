"""Helm test helpers: the helm binary that `make controlplane` builds, run on our chart."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeinfer.devcluster.config import default_bin_dir, pinned_kubernetes_version

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kubeinfer"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))


@dataclass
class Helm:
    path: Path
    kube_version: str

    def run(
        self, *args: str, kubeconfig: Path | None = None, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """helm ARGS..., never raising on a non-zero exit (tests read returncode and stderr)."""
        env_args = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
        return subprocess.run(
            [str(self.path), *args, *env_args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO,
        )

    def check(self, *args: str, kubeconfig: Path | None = None, timeout_s: float = 120) -> str:
        done = self.run(*args, kubeconfig=kubeconfig, timeout_s=timeout_s)
        if done.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}{done.stdout}"
            )
        return done.stdout

    def template(
        self, *args: str, release: str = "ki", namespace: str = "ops"
    ) -> list[dict[str, Any]]:
        """The chart rendered offline, as a list of objects (the Kubernetes version pinned:
        helm's own default is v1.20, below the chart's kubeVersion)."""
        out = self.check(
            "template", release, str(CHART), "--namespace", namespace,
            "--kube-version", self.kube_version, *args,
        )  # fmt: skip
        return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def helm() -> Helm:
    path = default_bin_dir() / "helm"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make controlplane`", pytrace=False)
    return Helm(path, pinned_kubernetes_version())
