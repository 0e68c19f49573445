"""Package list for setuptools (everything else is in pyproject.toml).

``trainer.*`` is found on disk; ``trainer.configs`` and ``trainer.recipes`` are the top-level ``configs/``
and ``recipes/`` folders (mapped in ``[tool.setuptools.package-dir]``), which ``find_packages`` cannot see
under those names. Without them an installed package would have no configs.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["trainer", "trainer.*"]), "trainer.configs", "trainer.recipes"])
