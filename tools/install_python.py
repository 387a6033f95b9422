#!/usr/bin/env python3
"""Installs the built Python packages `smp` and `smdistributed` (from <build>/python).

Usage (run with the interpreter that will import them, .venv/bin/python here):
    python3 tools/install_python.py BUILD_PYTHON_DIR [--prefix PREFIX | --target DIR]
    python3 tools/install_python.py BUILD_PYTHON_DIR --uninstall [...]

Destination: --target DIR as given; else the interpreter's site-packages for PREFIX
(Debian's python3 with PREFIX /usr/local, the default: /usr/local/lib/python3.X/
dist-packages; another prefix: PREFIX/lib/python3.X/site-packages, which then needs
PYTHONPATH). Only package files are copied (*.py and the compiled extension), never
build artifacts. Idempotent: each package is staged beside its destination and swapped
in whole, so files dropped from the build do not linger and an interrupted install
leaves the previous one intact.
"""
import argparse
import os
import shutil
import sys
import sysconfig

__all__ = []

PACKAGES = ("smp", "smdistributed")
# What a package consists of; everything else in the build dir (CMake files, object
# files, the precompiled header) stays behind.
SUFFIXES = (".py", ".pyi", ".so", ".typed")


def site_dir(prefix):
    """The directory this interpreter imports third-party packages from, under `prefix`."""
    default = sysconfig.get_path("platlib")
    if prefix is None:
        return default
    prefix = os.path.abspath(prefix)
    # Debian's schemes: posix_local maps /usr/local to /usr/local/lib/python3.X/
    # dist-packages, deb_system maps /usr to /usr/lib/python3/dist-packages.
    schemes = [None] + (["deb_system"] if "deb_system" in sysconfig.get_scheme_names() else [])
    for scheme in schemes:
        path = sysconfig.get_path("platlib", scheme) if scheme else default
        if path.startswith(os.path.join(prefix, "lib", "")):
            return path
    return sysconfig.get_path("platlib", "posix_prefix",
                              vars={"base": prefix, "platbase": prefix})

def package_files(src):
    """Relative paths of the files of package dir `src`, sorted."""
    out = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(SUFFIXES):
                out.append(os.path.relpath(os.path.join(root, f), src))
    return out


def install_package(src, dest):
    files = package_files(src)
    if not any(f == "__init__.py" for f in files):
        raise SystemExit(f"install_python: {src} is not a built package (no __init__.py)")
    stage, old = dest + ".smp-new", dest + ".smp-old"
    for d in (stage, old):
        shutil.rmtree(d, ignore_errors=True)
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(stage, f)), exist_ok=True)
        shutil.copy2(os.path.join(src, f), os.path.join(stage, f))
    if os.path.lexists(dest):
        os.rename(dest, old)
    os.rename(stage, dest)
    shutil.rmtree(old, ignore_errors=True)
    return len(files)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_python", help="<build>/python, as left by `make build`")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--prefix", help="install prefix (default: this Python's own)")
    where.add_argument("--target", help="exact directory to put the packages in")
    ap.add_argument("--uninstall", action="store_true", help="remove the packages instead")
    args = ap.parse_args(argv)

    dest_dir = os.path.abspath(args.target) if args.target else site_dir(args.prefix)
    if args.uninstall:
        for pkg in PACKAGES:
            path = os.path.join(dest_dir, pkg)
            if os.path.lexists(path):
                shutil.rmtree(path)
                print(f"install_python: removed {path}")
        return 0

    missing = [p for p in PACKAGES if not os.path.isdir(os.path.join(args.build_python, p))]
    if missing:
        raise SystemExit(f"install_python: {args.build_python} has no {', '.join(missing)}; "
                         "run `make build` first")
    os.makedirs(dest_dir, exist_ok=True)
    for pkg in PACKAGES:
        n = install_package(os.path.join(args.build_python, pkg), os.path.join(dest_dir, pkg))
        print(f"install_python: {pkg} ({n} files) -> {os.path.join(dest_dir, pkg)}")
    on_path = any(os.path.abspath(p) == dest_dir for p in sys.path if p)
    if not on_path:
        print(f"install_python: {dest_dir} is not on this Python's path; "
              f"use PYTHONPATH={dest_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
