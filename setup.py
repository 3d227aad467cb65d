"""Package list: `miles` plus the top-level `machines/` folder, shipped as `miles.machines`.

pyproject's `packages.find` cannot add a package whose folder sits outside `miles/`, hence this file.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["miles", "miles.*"]) + ["miles.machines"],
    package_dir={"miles.machines": "machines"},
)
