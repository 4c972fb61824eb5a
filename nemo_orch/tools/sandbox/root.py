"""What a worker sees of the host: its private root (the interpreter, its standard library, the
allowed packages and only the shared libraries these load) or, where there is none, the
directories a mount namespace re-exposes."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.tools.base import ToolError

logger = logging.getLogger(__name__)

# pivot_root(2) and keyctl(2) have no libc wrapper: their system call numbers, by machine.
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280}
SITE = "/usr/lib/python-sandbox/site-packages"
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Directories that may be links to their /usr counterparts: the links are kept in the root.
_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32")
# Libraries glibc opens by name at run time, not as anyone's dependency (libgcc_s: unwinding for
# thread cancellation and exit), taken from the C library's directory.
_RUNTIME_LIBRARIES = ("libgcc_s.so.1",)


@dataclass(frozen=True)
class PrivateRoot:
    """What a worker's private root holds (``private-root``): host paths bound read-only at
    the same place (``binds``: the interpreter, its standard library, the allowed packages,
    each shared library these load, a few device nodes, which are writable), symlinks
    (``links``: the host's ``/lib -> usr/lib`` and the like, ``/dev/fd``, the interpreter's
    aliases), empty read-only directories over what a bound tree holds beyond what is allowed
    (``covers``: the interpreter's own site-packages), and private empty tmpfs directories
    (``scratch``). The worker's directory is bound writable; ``/proc`` is its PID
    namespace's. Library directories (``staged``: each with its libraries, as (file, name))
    are read-only directories the zygote makes once, and each call binds whole. The allowed
    packages are bound under ``SITE``, which the call adds to ``sys.path`` (``sys_path``)."""

    binds: tuple[tuple[str, str, bool], ...]
    links: tuple[tuple[str, str], ...]
    covers: tuple[str, ...]
    staged: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    sys_path: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")


def _mount_point(workdir: Path) -> Path:
    """Where a worker's private root is mounted, beside its directory (empty on the host)."""
    return workdir.with_name(workdir.name + ".root")


@functools.cache
def _private_root(allowed_packages: tuple[str, ...]) -> PrivateRoot | None:
    """The private root of this interpreter: its executable, standard library and
    ``libpython``, ``allowed_packages`` from its site-packages (top-level names; each one's
    ``<name>.libs`` of bundled libraries too), the shared libraries these load and device
    nodes; None where those libraries cannot be found (no ``ldd``). Resolved once per
    process: the host's libraries do not change under it."""
    ldd = shutil.which("ldd")
    if ldd is None:
        logger.warning(
            "python_sandbox: no `ldd` (glibc's libc-bin) to find the shared "
            "libraries the interpreter loads: no private root"
        )
        return None
    binds: list[tuple[str, str, bool]] = []
    links: list[tuple[str, str]] = [("/dev/fd", "/proc/self/fd")]
    links += [
        (directory, os.readlink(directory))
        for directory in _LIBRARY_DIRS
        if os.path.islink(directory)
    ]
    # The zygote runs the interpreter by its real path: no alias (a virtual environment's, in a
    # checkout) needs to exist in the root.
    executable = os.path.realpath(sys.executable)
    binds.append((executable, executable, False))
    stdlib = sysconfig.get_path("stdlib")
    binds.append((stdlib, stdlib, False))
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libpython = [
        str(path)
        for path in sorted(Path(libdir).glob("libpython*"))
        if not str(path).startswith(stdlib)
    ]
    binds += [(path, path, False) for path in libpython]
    covers = [str(path) for path in [Path(stdlib, "site-packages")] if path.is_dir()]
    # What the dynamic loader maps: the interpreter, libpython, the standard extension modules
    # and every shared object an allowed package ships.
    loaded = [executable, *libpython, *map(str, Path(stdlib, "lib-dynload").glob("*.so"))]
    # The allowed packages at a fixed place (SITE), not where they are installed (a checkout's
    # virtual environment); their bundled libraries come with them.
    packages = [path for name in allowed_packages for path in package_paths(name)]
    for path in packages:
        binds.append((path, f"{SITE}/{os.path.basename(path)}", False))
        loaded += _shared_objects(Path(path))
    binds += [(device, device, True) for device in _DEVICES if os.path.exists(device)]
    bound = {target for _, target, _ in binds} | set(packages)
    directories: dict[str, list[tuple[str, str]]] = {}
    for target, source in _shared_libraries(ldd, loaded).items():
        if not any(target == path or target.startswith(path + "/") for path in bound):
            directories.setdefault(os.path.dirname(target), []).append(
                (source, os.path.basename(target))
            )
    # A directory bound whole would hide what else the root holds under it (the pyenv's lib/
    # holds the standard library): its libraries are bound one by one.
    inside = [*bound, *covers, *(link for link, _ in links), *PrivateRoot.scratch]
    staged = []
    for directory, files in directories.items():
        if any(path.startswith(directory + "/") for path in inside):
            binds += [(source, f"{directory}/{name}", False) for source, name in files]
        else:
            staged.append((directory, tuple(files)))
    return PrivateRoot(
        tuple(binds), tuple(links), tuple(covers), tuple(staged), (SITE,) if packages else ()
    )


def package_paths(name: str) -> list[str]:
    """Where an allowed package (a top-level name) is installed: its directory or module and
    its bundled libraries (``<name>.libs``, inside or beside it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise ToolError(f"python_sandbox: allowed package {name!r} is not installed")
    where = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
    found = [where, f"{where}.libs", str(Path(where).with_name(f"{name}.libs"))]
    return [path for path in dict.fromkeys(found) if os.path.exists(path)]


def _shared_objects(path: Path) -> list[str]:
    """The shared objects at or under ``path``."""
    candidates = path.rglob("*.so*") if path.is_dir() else [path]
    return [
        str(candidate)
        for candidate in candidates
        if (candidate.name.endswith(".so") or ".so." in candidate.name) and candidate.is_file()
    ]


def _shared_libraries(ldd: str, objects: Sequence[str]) -> dict[str, str]:
    """The libraries the dynamic loader maps for ``objects`` (their dependencies, the loader
    itself, and those glibc opens by name at run time), as {path the loader opens: file}:
    the path with its directory resolved (``/lib`` is a link in the private root too), the
    file with every link resolved, so that it can be bound there. ``objects`` are the
    interpreter's and the allowed packages' own, which this process loads anyway: ``ldd``
    may run their loader."""
    # It exits 1 when any one of them is not a dynamic object (e.g. a statically linked one).
    listed = subprocess.run(
        [ldd, *objects],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"LC_ALL": "C", "PATH": os.defpath},
    ).stdout
    paths = []
    for line in listed.splitlines():
        # "\tlibc.so.6 => /lib/.../libc.so.6 (0x...)", "\t/lib64/ld-linux-x86-64.so.2 (0x...)";
        # not "\tlinux-vdso.so.1 (0x...)", "\tlibfoo.so => not found" or a file's own name.
        if line.startswith("\t"):
            path = line.split(" => ", 1)[-1].strip().split(" (", 1)[0]
            if path.startswith("/"):
                paths.append(path)
    libc = next((path for path in paths if Path(path).name.startswith("libc.so")), None)
    if libc is not None:
        paths += [
            str(Path(libc).with_name(name))
            for name in _RUNTIME_LIBRARIES
            if Path(libc).with_name(name).is_file()
        ]
    return {
        os.path.join(
            os.path.realpath(os.path.dirname(path)), os.path.basename(path)
        ): os.path.realpath(path)
        for path in paths
        if os.path.isfile(path)
    }


def _hidden_prefixes() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Directories other users cannot search that contain the interpreter's prefixes (e.g. a
    pyenv under /root), each with the prefixes to bind back into its covering tmpfs."""
    hidden: dict[str, set[str]] = {}
    for prefix in {sys.base_prefix, sys.prefix}:
        path = Path(prefix).resolve()
        for ancestor in [*reversed(path.parents), path][1:]:
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                hidden.setdefault(str(ancestor), set()).add(str(path))
                break
    return tuple((directory, tuple(sorted(prefixes))) for directory, prefixes in hidden.items())
