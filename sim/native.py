"""The optional compiled build of the simulator's hot modules (mypyc), and the guard against a stale one.

``python tools/build_native.py`` compiles :data:`MODULES` with mypyc (https://mypyc.readthedocs.io)
into extension modules next to their sources; Python then imports those instead of the ``.py`` files.
Nothing else changes: the same source, the same order of everything, byte-identical records
(tests/sim/test_native_build.py compares benchmarks/sim_fingerprint.py's every line across the two
builds). impl/policy is not compiled: it stays the pure-Python code the real router and connector run.

An extension module would keep running after its source was edited, so the build writes a stamp of
every source's SHA-256, and importing ``sim`` checks it (:func:`install_guard`): when any source
changed since the build, or the stamp or a compiled file is missing, every compiled module is loaded from its source
instead (all of them: a class compiled in one module cannot be subclassed by an interpreted one in
another) and a warning names what changed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# what a simulated turn runs through, by its share of a 64P64D run's time; the rest (configs, workload
# generation, records, reports) is not worth a build step
MODULES = ("sim.engine.instant", "sim.engine.interconnect", "sim.engine.decode", "sim.engine.prefill", "sim.engine.router", "sim.clients.conversation")
# the shared library mypyc builds for the group (in the package, so an installed sim finds it)
GROUP = "sim._native"
STAMP = PACKAGE_DIR / "_native.json"
PURE_ENV = "BIDIKV_PURE_SIM"


def _within(module: str) -> str:
    """A module's path inside the package, without suffix: "sim.engine.decode" -> "engine/decode"."""
    return "/".join(module.split(".")[1:])


def source_path(module: str, package_dir: Path = PACKAGE_DIR) -> Path:
    return package_dir / (_within(module) + ".py")


def _compiled_names() -> list[str]:
    """The compiled files' paths inside the package, without suffix: each beside its source."""
    return [_within(m) for m in MODULES] + [_within(GROUP) + "__mypyc"]


def extension_paths(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The compiled files present: one per module and the group's shared library."""
    return [package_dir / (name + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES
            for name in _compiled_names() if (package_dir / (name + suffix)).exists()]


def source_digests(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    return {m: hashlib.sha256(source_path(m, package_dir).read_bytes()).hexdigest() for m in MODULES}


def staleness(package_dir: Path = PACKAGE_DIR) -> str | None:
    """Why a compiled build present in ``package_dir`` must not run ("" when it may; None: no build)."""
    present = {p.relative_to(package_dir).as_posix().split(".", 1)[0] for p in extension_paths(package_dir)}
    if not present:
        return None
    missing = [name for name in _compiled_names() if name not in present]
    if missing:  # a build cut short, or half removed
        return "compiled files are missing: " + ", ".join(missing)
    try:
        built = json.loads((package_dir / STAMP.name).read_text())["sources"]
        if not isinstance(built, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"its stamp sim/{STAMP.name} is missing or unreadable"
    changed = [m for m, digest in source_digests(package_dir).items() if built.get(m) != digest]
    if changed:
        return ", ".join(f"sim/{_within(m)}.py" for m in changed) + " changed since it was built"
    return ""


class _SourcesFirst(importlib.abc.MetaPathFinder):
    """Loads :data:`MODULES` from their ``.py`` files, ahead of the extension modules beside them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        source = str(source_path(fullname))
        return importlib.util.spec_from_file_location(fullname, source,
                                                      loader=importlib.machinery.SourceFileLoader(fullname, source))


def _sources_first() -> None:
    if not any(isinstance(finder, _SourcesFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst())


def install_guard() -> None:
    """Called by ``sim/__init__``: use a stale build's sources instead, and say so; with
    ``BIDIKV_PURE_SIM=1`` use the sources whatever is built (the test suite does: its tests wrap methods
    of simulator objects, which compiled classes do not allow)."""
    why = staleness()
    if why is None:
        return
    if os.environ.get(PURE_ENV) == "1":
        _sources_first()
        return
    if why:
        _sources_first()
        warnings.warn(f"sim: the compiled build is stale ({why}): running the pure-Python sources. Rebuild "
                      f"with `python tools/build_native.py`, or remove it with `python tools/build_native.py "
                      f"--clean`", RuntimeWarning, stacklevel=2)


def describe() -> str:
    """What ``import sim`` runs here and why, one line (``tools/build_native.py --status``)."""
    why = staleness()
    if why is None:
        return "pure Python: no compiled build in sim/"
    if os.environ.get(PURE_ENV) == "1":
        return f"pure Python: {PURE_ENV}=1 (a compiled build is present" + (f", stale: {why})" if why else ")")
    if why:
        return f"pure Python: the compiled build is stale ({why})"
    return f"native (mypyc): {len(MODULES)} modules compiled, sources unchanged since the build"


def build_name() -> str:
    """Which build the simulator runs: "native (mypyc)" or "pure Python" (import time decides)."""
    import sim.engine.decode

    return "native (mypyc)" if not sim.engine.decode.__file__.endswith(".py") else "pure Python"
