"""Maps the top-level folders onto the `pdcluster` namespace.

pyproject.toml cannot express "every subpackage of runtime/ under
pdcluster.runtime", so the package list is computed here.
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
