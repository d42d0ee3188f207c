"""Which packages the distribution holds; everything else is in pyproject.toml.

The repository keeps `layout/` and `transport/` as top-level folders (one
concept each, dependencies pointing one way), but they install and import as
`pdxfer.layout` and `pdxfer.transport`: generic top-level names would
collide in a serving environment. pyproject.toml can map those folders, but
it can either list every package by hand — which drifted: `pdxfer.lifecycle`
was added and never listed, and a non-editable install could not import
pdxfer at all — or discover packages under their folder names, which would
install top-level `layout` and `transport`. So the packages are found here,
per mapped folder, and prefixed with the name that folder installs as:
every nested package (one with an `__init__.py`) is found, whoever adds it.
`tests/test_wheel_install.py` builds the wheel and looks for every module.
`examples/` and `tests/` are run from a checkout and never installed.
"""

from setuptools import find_packages, setup

# installed package -> repository folder
PACKAGE_DIR = {"pdxfer": "pdxfer", "pdxfer.layout": "layout", "pdxfer.transport": "transport"}


def packages() -> list[str]:
    """Every package under each mapped folder, named as it installs."""
    found = []
    for name, folder in PACKAGE_DIR.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=PACKAGE_DIR)
