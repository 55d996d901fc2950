#!/usr/bin/env bash
# timed.sh STAGE CMD...: run CMD, then print how long the stage took (make test prints each stage).
set -uo pipefail
stage=$1; shift
start=$(date +%s)
echo "==> [$stage] $*"
"$@"
rc=$?
echo "==> [$stage] $(( $(date +%s) - start ))s (exit $rc)"
exit $rc
