"""Compile the simulator's hot modules with mypyc (sim.native), or remove the compiled build.

Run: python tools/build_native.py [--clean | --status]

Needs mypy (the ``native`` extra: ``pip install -e '.[native]'``) and a C compiler with the Python
headers. The extension modules land next to their sources in sim/, with a stamp of the sources they
were built from; importing sim falls back to the sources (with a warning) once any of them changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

with warnings.catch_warnings():  # a stale build is what this is run to replace: no warning about it
    warnings.simplefilter("ignore", RuntimeWarning)
    from sim import native  # noqa: E402  (this checkout's sim, not an installed one)


def clean() -> list[Path]:
    removed = native.extension_paths()
    for path in removed:
        path.unlink()
    native.STAMP.unlink(missing_ok=True)
    return removed


def build() -> None:
    try:
        import mypyc  # noqa: F401
    except ImportError:
        sys.exit("tools/build_native.py: mypyc is not installed (it comes with mypy): pip install -e '.[native]'")
    clean()  # no stamp until the new build is complete: a failed build leaves the sources in charge
    digests = native.source_digests()  # what is compiled: read before compiling, so an edit meanwhile shows as stale
    # mypy's and the C compiler's output only matters when they fail
    done = subprocess.run([sys.executable, __file__, "--compile"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        clean()
        sys.exit(f"tools/build_native.py: the build failed (exit {done.returncode}); the sources stay in use:\n"
                 f"{done.stdout[-6000:]}{done.stderr[-6000:]}")
    native.STAMP.write_text(json.dumps({"sources": digests}, indent=1, sort_keys=True) + "\n")


def compile_in_place() -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    os.chdir(ROOT)  # mypyc names modules by their paths from here
    with tempfile.TemporaryDirectory(prefix="bidikv-native-") as work:
        paths = [str(native.source_path(m).relative_to(ROOT)) for m in native.MODULES]
        # mypy's options: third-party packages without type information are taken as Any
        extensions = mypycify(paths + ["--ignore-missing-imports", "--follow-imports=silent",
                                       "--cache-dir", os.path.join(work, "mypy_cache")],
                              opt_level="3", group_name=native.GROUP, target_dir=os.path.join(work, "c"))
        command = build_ext(Distribution({"ext_modules": extensions}))
        command.inplace = True
        command.build_temp = os.path.join(work, "temp")
        command.ensure_finalized()
        command.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--clean", action="store_true", help="remove the compiled build (the sources run again)")
    group.add_argument("--status", action="store_true", help="say which build `import sim` runs, and why")
    group.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the build's child process
    args = parser.parse_args()
    if args.compile:
        compile_in_place()
        return
    if args.clean:
        removed = clean()
        print(f"removed {len(removed)} compiled files" + "".join(f"\n  {p.relative_to(ROOT)}" for p in removed))
        return
    if args.status:
        print(native.describe())
        return
    build()
    print(f"built {len(native.MODULES)} modules: " + ", ".join(native.MODULES))


if __name__ == "__main__":
    main()
