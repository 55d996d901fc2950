"""One distribution maps the folders into `kubeinfer.*`; the standard `operator` stays intact.

The folder `operator/` must never be importable as a top-level `operator`: that would shadow
Python's standard module for every library in the process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [
    "kubeinfer",
    "kubeinfer.runtime",
    "kubeinfer.kernels",
    "kubeinfer.operator",
    "kubeinfer.router",
    "kubeinfer.runtime.models",
    "kubeinfer.cli",
]
# Only a checkout's editable install has these (setup.py leaves them out of the wheel).
DEV_ONLY = ["kubeinfer.devcluster", "kubeinfer.runtime.testing", "kubeinfer.operator.testing"]
STDLIB = sysconfig.get_paths()["stdlib"]

PROBE = f"""
import importlib, operator, sys
assert operator.__file__.startswith({STDLIB!r}), operator.__file__
assert operator.itemgetter(1)([0, 7]) == 7
for name in {PACKAGES!r}:
    importlib.import_module(name)
import kubeinfer.operator
assert kubeinfer.operator is not operator
print(importlib.import_module("kubeinfer").__file__)
"""
# with_dev: the dev-only modules import and `kubeinfer dev` exists; else neither
PROBE_DEV = """
import importlib, sys
from kubeinfer.cli import app
names = {{g.name for g in app.registered_groups}}
for name in {dev!r}:
    try:
        importlib.import_module(name)
        found = True
    except ModuleNotFoundError:
        found = False
    assert found is {with_dev}, (name, found)
assert ("dev" in names) is {with_dev}, names
assert "operator" in names, names
"""


def probe(cwd: Path, env: dict[str, str] | None = None, with_dev: bool = True) -> str:
    code = PROBE + PROBE_DEV.format(dev=DEV_ONLY, with_dev=with_dev)
    if not with_dev:  # the wheel alone: this venv's editable finder would map the checkout in
        code = (
            "import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n" + code
        )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_editable_install_imports(tmp_path: Path, where: str) -> None:
    # from the repo root too, where a bare `import operator` could find the folder first
    location = probe(REPO if where == "repo" else tmp_path)
    assert Path(location).resolve() == (REPO / "kubeinfer" / "__init__.py").resolve()


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path: Path) -> None:
    # built from a copy of the tracked and new files: a checkout's build/ may hold stale modules
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    source = tmp_path / "src"
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("kubeinfer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kubeinfer/operator/__init__.py" in names
    assert "kubeinfer/runtime/models/llama.py" in names
    assert "kubeinfer/kernels/cpu/paged_attention.cpp" in names  # built where it runs
    assert "kubeinfer/kernels/cpu/common.h" in names
    assert "kubeinfer/router/picker.py" in names
    # what only a checkout uses stays out: the dev cluster and the test helpers
    assert not any(n.startswith("kubeinfer/devcluster/") for n in names), names
    assert "kubeinfer/runtime/testing.py" not in names
    assert "kubeinfer/operator/testing.py" not in names
    assert not any(n.startswith(("operator/", "runtime/", "kernels/")) for n in names), names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    location = probe(tmp_path, env, with_dev=False)
    assert location.startswith(str(target)), location  # the wheel's copy, not the checkout


def test_every_package_folder_is_listed() -> None:
    """A sub-package with an __init__.py that pyproject forgets would be missing from wheels."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {v: k for k, v in config["package-dir"].items()}
    found = set()
    for folder, package in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *rel)))
    assert found <= set(config["packages"]), found - set(config["packages"])


# The operator's install is the core distribution alone (docker/operator.Dockerfile): torch,
# safetensors and numpy come only with the `runtime` extra. Importing them is made to fail.
WITHOUT_RUNTIME = """
import importlib.abc, sys
class NoRuntime(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "safetensors", "numpy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoRuntime())
"""


def _without_runtime(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RUNTIME + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("modules", "command"),
    [
        ("kubeinfer.operator.main, kubeinfer.operator.autoscale_daemon", "operator"),
        # `kubeinfer router` ships in the core install: the operator's image can run it
        ("kubeinfer.router.app, kubeinfer.router.serve", "router"),
    ],
)
def test_the_operator_router_and_cli_run_without_the_runtime_extra(
    modules: str, command: str
) -> None:
    out = _without_runtime(
        f"import {modules}\n"
        "from kubeinfer.cli import app\n"
        "from typer.testing import CliRunner\n"
        f"r = CliRunner().invoke(app, [{command!r}, '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('ok')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_serve_without_the_runtime_extra_says_what_to_install() -> None:
    out = _without_runtime(
        "import sys\n"
        "from kubeinfer.cli import app\n"
        "sys.argv = ['kubeinfer', 'serve', '--model', '/nonexistent']\n"
        "app()\n"
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "pip install 'kubeinfer[runtime]'" in out.stderr
    assert "torch" in out.stderr
