"""tcmalloc under the CPU engine (runtime/malloc.py): when a re-exec applies, and that it does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kubeinfer.runtime import malloc

LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_preload_env_adds_tcmalloc_once_and_leaves_other_mallocs() -> None:
    env = malloc.preload_env({"LD_PRELOAD": "/x/libiomp5.so", "A": "1"}, LIB)
    assert env is not None and env["LD_PRELOAD"] == f"{LIB}:/x/libiomp5.so" and env["A"] == "1"
    assert malloc.preload_env(env, LIB) is None  # the re-exec'd process never re-execs
    for env in (
        malloc.preload_env({}, None),  # not installed
        malloc.preload_env({"KUBEINFER_TCMALLOC": "0"}, LIB),  # switched off
        malloc.preload_env({"LD_PRELOAD": "/y/libjemalloc.so.2"}, LIB),
    ):  # still a re-exec: for the huge pages alone
        assert env is not None and "tcmalloc" not in env.get("LD_PRELOAD", "")
        assert env[malloc.THP] == "1"


def test_huge_pages_are_on_unless_the_environment_says_otherwise() -> None:
    env = malloc.preload_env({}, LIB)
    assert env is not None and env[malloc.THP] == "1"
    env = malloc.preload_env({malloc.THP: "0"}, LIB)
    assert env is not None and env[malloc.THP] == "0" and env["LD_PRELOAD"] == LIB
    # nothing to change: no re-exec at all
    assert malloc.preload_env({malloc.THP: "0", "KUBEINFER_TCMALLOC": "0"}, LIB) is None


def _run(env: dict[str, str]) -> str:
    code = (
        "from kubeinfer.runtime import malloc; malloc.reexec_with_tcmalloc(); "
        "import os; print(open('/proc/self/maps').read().count('tcmalloc') > 0, "
        "os.environ.get('THP_MEM_ALLOC_ENABLE'), flush=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(malloc.find_tcmalloc() is None, reason="libtcmalloc-minimal4 not installed")
def test_the_process_reexecs_itself_with_tcmalloc_mapped() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.MARK)}
    env.pop(malloc.THP, None)
    assert _run(env) == "True 1"
    assert _run({**env, "KUBEINFER_TCMALLOC": "0"}) == "False 1"
    assert _run({**env, malloc.THP: "0"}) == "True 0"
