"""The wheel leaves out what only a checkout uses: the dev cluster (`kubeinfer dev`, which
builds and runs a control plane from this tree's caches) and the test helpers. An editable
install (`make venv`) keeps them: `kubeinfer dev` works from the checkout, as the tests need.
Everything else is in pyproject.toml."""

from setuptools import setup
from setuptools.command.build_py import build_py

DEV_PACKAGES = ("kubeinfer.devcluster", "kubeinfer.devcluster.nodeagent")
DEV_MODULES = {("kubeinfer.runtime", "testing"), ("kubeinfer.operator", "testing")}


class BuildPy(build_py):
    def finalize_options(self) -> None:
        super().finalize_options()
        if not getattr(self, "editable_mode", False):
            self.packages = [p for p in self.packages or [] if p not in DEV_PACKAGES]

    def find_package_modules(self, package: str, package_dir: str) -> list:
        modules = super().find_package_modules(package, package_dir)
        if getattr(self, "editable_mode", False):
            return modules
        return [m for m in modules if (m[0], m[1]) not in DEV_MODULES]


setup(cmdclass={"build_py": BuildPy})
