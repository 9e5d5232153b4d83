"""The wheel's packages, read from the tree so that no list is kept by hand.

Everything else is declared in pyproject.toml, and so is the one mapping from import names to folders
([tool.setuptools.package-dir]: ``edgefleet.agent`` is the folder agent/, ...). Here, each folder with an
``__init__.py`` under a mapped folder becomes a package of the wheel (fleet/rollout/ is ``edgefleet.fleet.rollout``),
so a new subpackage cannot be left out of the wheel; and a build starts from an empty build/lib/edgefleet, so a
module moved or removed since the last build cannot ship from there. docs/architecture.md says why the folders
are mapped.
"""

import shutil
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py


class TreeDistribution(Distribution):
    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)  # reads pyproject.toml, package-dir included
        self.packages = sorted(
            ".".join(filter(None, (name, sub)))
            for name, folder in self.package_dir.items()
            for sub in ("", *find_packages(folder)))


class FreshBuildPy(build_py):
    def run(self):
        shutil.rmtree(Path(self.build_lib) / "edgefleet", ignore_errors=True)
        super().run()


setup(distclass=TreeDistribution, cmdclass={"build_py": FreshBuildPy})
