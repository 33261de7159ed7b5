"""Import every module of an installed kvray: the check that an install (a wheel, the serving
image) ships all of its code and that code's import-time dependencies.

    python -m cluster.install_check    # lists where each package loaded from; exit 1 on a failure

Run it from outside a source checkout: `python -m` puts the working directory first on the
path, and a checkout there would be imported instead of the install. The serving image runs it
after installing the wheel; tests/test_packaging.py runs it against a freshly built wheel.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback

# The top-level packages a kvray install provides (the gRPC stubs are `kvray`).
PACKAGES = ("workers", "cluster", "kvray")
# Never imported: a package's __main__ runs its command when imported, and has no other job.
SKIPPED_NAMES = ("__main__",)


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def import_all(packages: tuple[str, ...] = PACKAGES) -> tuple[list[str], dict[str, str]]:
    """Import each package and, depth first, every module and subpackage it contains on disk.
    Returns (modules imported, {module: error} for each that failed); a package that fails
    to import is reported once and its contents are not walked."""
    imported: list[str] = []
    failed: dict[str, str] = {}
    pending = list(reversed(packages))
    while pending:
        name = pending.pop()
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # every failure is the report, whatever its type
            failed[name] = _error(exc)
            continue
        imported.append(name)
        path = getattr(module, "__path__", None)
        if path is None:
            continue
        children = sorted(
            f"{name}.{info.name}"
            for info in pkgutil.iter_modules(path)
            if info.name not in SKIPPED_NAMES
        )
        pending.extend(reversed(children))
    return imported, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.install_check", description=__doc__.split("\n\n")[0]
    )
    parser.parse_args(argv)
    imported, failed = import_all()
    for package in PACKAGES:
        if package in sys.modules:
            print(f"{package}: {sys.modules[package].__file__}")
    for module, error in failed.items():
        print(f"FAILED {module}: {error}", file=sys.stderr)
    print(f"imported {len(imported)} modules, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
