"""`make demo`'s script, run as CI runs it, on a dev cluster of its own, torn down after: it must
answer the first question from zero replicas through the router, scale above one replica under
load and back to zero, and draw its plot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]


def test_demo_tells_the_whole_story(tmp_path: Path, smollm2_dir: Path) -> None:
    png = tmp_path / "demo-timeline.png"
    # its own cluster: the demo installs an operator for every namespace, which must not meet
    # the operator tests' own operators on the shared test cluster
    state = Path.home() / ".cache" / "kubeinfer" / "dev-demo-test"
    env = {**os.environ, "DEMO_KEEP": "0", "DEMO_PNG": str(png), "KUBEINFER_DEV_DIR": str(state)}
    done = subprocess.run(
        [sys.executable, str(REPO / "hack" / "demo.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    out = done.stdout
    print(out[-6000:])
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    answer = re.search(r"answer: (.*)", out)
    assert answer and "Paris" in answer.group(1), out[-3000:]
    assert re.search(r"router ready at http://127\.[\d.]+:8000; replicas 0", out), out[-3000:]
    assert re.search(r"cold start: answered [\d.]+s after the request", out), out[-3000:]
    scaled = re.search(r"replicas: 0 -> 1 \(cold start\) -> (\d+) \(ready\) -> (\d+)", out)
    assert scaled and int(scaled.group(1)) > 1 and scaled.group(2) == "0", out[-3000:]
    assert png.stat().st_size > 10_000
    assert "NAME" in out and "smollm2-zero" in out  # kubectl get im
    assert "demo OK" in out
