"""Maps the top-level folders onto the `pdcluster` namespace.

pyproject.toml cannot express "every subpackage of runtime/ under
pdcluster.runtime", so the package list is computed here.

runtime/ and operator/ have no `__init__.py`: `pdcluster.runtime` and
`pdcluster.operator` are namespace packages. A tool started at the
repository root (`python -m ...` puts the current directory first on
sys.path) then finds the standard library's `operator` module, which a
regular top-level package `operator/` would shadow.
"""

from setuptools import find_packages, setup

PACKAGE_ROOTS = {"pdcluster.runtime": "runtime", "pdcluster.operator": "operator"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in PACKAGE_ROOTS.items():
        packages.append(name)
        package_dir[name] = folder
        for sub in find_packages(folder):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, package_data={"pdcluster.runtime": ["py.typed"]})
