"""Package discovery only; everything else is in pyproject.toml.

setuptools' `packages.find` cannot discover a package whose folder is mapped elsewhere
(`raystate.kernels` lives in the top-level `kernels/`), so the subpackages of `raystate` are found
here and the mapped one is added by name. A new `raystate/<pkg>/` needs no edit anywhere.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["raystate", "raystate.*"]), "raystate.kernels"])
