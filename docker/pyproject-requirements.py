"""Prints the requirements pyproject.toml declares, one a line, for `pip install -r`:
[project].dependencies plus the optional-dependency groups named as arguments.

    python docker/pyproject-requirements.py pyproject.toml [EXTRA ...]

The Dockerfile installs these in a layer of their own, before it copies the sources, so the
layer is rebuilt only when pyproject.toml (or docker/constraints.txt) changes.
"""
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib

with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)["project"]
requirements = list(project.get("dependencies", []))
for extra in sys.argv[2:]:
    requirements += project.get("optional-dependencies", {})[extra]
print("\n".join(requirements))
