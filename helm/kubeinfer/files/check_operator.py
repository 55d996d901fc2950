"""`helm test`: the operator's pod is ready and answers /healthz, and the API serves kubeinfer.dev.

Runs in the operator image (python + the kubernetes client) with a test service account that
may only read pods in the release namespace. The operator is found by its pods' labels and
reached at its pod IP, never through a Service, so this works on the dev cluster too.
"""

import os
import sys
import time
import urllib.request

from kubernetes import client, config

NAMESPACE = os.environ["RELEASE_NAMESPACE"]
SELECTOR = os.environ["OPERATOR_SELECTOR"]
PORT = int(os.environ["LIVENESS_PORT"])
DEADLINE = time.monotonic() + float(os.environ["TIMEOUT_S"])


def ready_pod_ips(core: client.CoreV1Api) -> list[str]:
    ips = []
    for pod in core.list_namespaced_pod(NAMESPACE, label_selector=SELECTOR).items:
        conditions = pod.status.conditions or []
        if any(c.type == "Ready" and c.status == "True" for c in conditions) and pod.status.pod_ip:
            ips.append(pod.status.pod_ip)
    return ips


def healthz(ip: str) -> int:
    with urllib.request.urlopen(f"http://{ip}:{PORT}/healthz", timeout=5) as resp:  # noqa: S310
        return int(resp.status)


def main() -> int:
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config()
    else:
        config.load_incluster_config()
    groups = {g.name for g in client.ApisApi().get_api_versions().groups}
    if "kubeinfer.dev" not in groups:
        print("FAIL: the API server does not serve kubeinfer.dev (is the CRD installed?)")
        return 1
    core = client.CoreV1Api()
    last = "no ready operator pod"
    while time.monotonic() < DEADLINE:
        try:
            ips = ready_pod_ips(core)
            if ips:
                codes = {ip: healthz(ip) for ip in ips}
                if all(code == 200 for code in codes.values()):
                    print(f"OK: operator at {', '.join(ips)}: ready, /healthz 200")
                    return 0
                last = f"/healthz answers {codes}"
        except Exception as exc:  # noqa: BLE001 - keep trying until the deadline
            last = f"{exc.__class__.__name__}: {exc}"
        time.sleep(1)
    print(f"FAIL: {last}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
