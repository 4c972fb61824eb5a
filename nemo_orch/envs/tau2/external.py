"""tau2 domains from directories outside the tau2 package (ToolOrchestra's synthetic domains),
registered in tau2's own registry, so that tau2 builds their environments, runs their tools on
their databases and scores their episodes exactly as it does its own domains'.

A domain is a directory in tau2's layout, the domain named by the directory::

    <name>/data_model.py  the database's model: exactly one subclass of tau2's ``DB``
    <name>/tools.py       the tools: exactly one ``ToolKitBase`` subclass, built on the database,
                          its tools the ``@is_tool(ToolType.READ / WRITE)`` methods
    <name>/db.json        the initial database
    <name>/policy.md      the domain policy (the agent's system prompt)
    <name>/tasks.json     optional: its tasks, a JSON list of tau2 ``Task`` objects

The directory is imported as the package ``tau2.domains.<name>`` (where tau2's own domains
live), so ``tools.py`` imports its data model relatively (``from .data_model import BankDB``)
or as a domain inside tau2 does (``from tau2.domains.bank.data_model import BankDB``, the
reference's files unchanged); other modules of the directory are imported alike. A domain's
name is therefore a Python identifier.

tau2's registry is per process: every process that builds or scores the environment registers
the directories (:class:`~nemo_orch.envs.tau2.Tau2Environment` does, for ``env.tau2_domains``).
Registering a directory again is a no-op; a name tau2 already has (its own domains', another
directory's) is an error.

A domain's tasks are its ``tasks.json``, or, for any tau2 domain, the rows of a task file
(``env.path``, :func:`~nemo_orch.envs.tau2.adapter.read_task_file`). A domain has no splits:
every split names its one task set, as for tau2's ``mock``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from nemo_orch.data.records import read_records
from nemo_orch.envs.tau2.adapter import Tau2Error, _tau2, tau2_tasks

DATA_MODEL, TOOLS, DB_FILE, POLICY = "data_model.py", "tools.py", "db.json", "policy.md"
PARTS = (DATA_MODEL, TOOLS, DB_FILE, POLICY)
TASKS_FILE = "tasks.json"
PACKAGE = "tau2.domains"

# The directories registered in this process, by domain name.
_registered: dict[str, Path] = {}


def register_domain_directory(directory: str | Path) -> str:
    """Register the domain of ``directory`` (see the module docstring) with tau2, its
    environment and its ``tasks.json`` loader, and return its name. Anything wrong with the
    directory (a part missing, a module that does not import, a database that does not load)
    is a :class:`Tau2Error` naming the file, and where known its line."""
    directory = Path(directory).resolve()
    name = directory.name
    if _registered.get(name) == directory:
        return name
    registry = _tau2().registry
    if name in _registered or name in registry.get_domains() + registry.get_task_sets():
        owner = _registered.get(name, "tau2 itself")
        raise Tau2Error(
            f"{directory}: tau2 already has a domain {name!r} (from {owner}); a "
            "domain is named by its directory: rename it"
        )
    if not name.isidentifier():
        raise Tau2Error(
            f"{directory}: a tau2 domain's directory name is its package's "
            f"({PACKAGE}.<name>), so it must be a Python identifier, not {name!r}"
        )
    for part in PARTS:
        if not (directory / part).is_file():
            raise Tau2Error(
                f"{directory / part}: no such file; a tau2 domain directory holds "
                f"{', '.join(PARTS)}"
            )
    package = f"{PACKAGE}.{name}"
    if importlib.util.find_spec(package) is not None:
        raise Tau2Error(f"{directory}: tau2 already has a package {package}; rename the directory")
    try:
        make_environment = _environment_constructor(name, directory, package)
    except BaseException:
        _forget(package)
        raise
    registry.register_domain(make_environment, name)
    registry.register_tasks(lambda task_split_name=None: _directory_tasks(directory), name)
    _registered[name] = directory
    return name


def _environment_constructor(name: str, directory: Path, package: str) -> Any:
    """``get_environment`` of the domain (a fresh environment on its initial database, as
    tau2's evaluator calls it), its modules imported and one environment built to check it."""
    tau2 = _tau2()
    _import_package(package, directory)
    db_class = _single_subclass(
        _import(f"{package}.data_model", directory, DATA_MODEL), tau2.db.DB, directory / DATA_MODEL
    )
    toolkit_class = _single_subclass(
        _import(f"{package}.tools", directory, TOOLS), tau2.toolkit.ToolKitBase, directory / TOOLS
    )
    policy = (directory / POLICY).read_text(encoding="utf-8")
    db_path = directory / DB_FILE

    def get_environment(solo_mode: bool = False) -> Any:
        return tau2.environment.Environment(
            domain_name=name,
            policy=policy,
            tools=toolkit_class(db_class.load(str(db_path))),
            solo_mode=solo_mode,
        )

    try:
        db_class.load(str(db_path))
    except Exception as error:  # tau2's loader: OSError, JSON, format and pydantic errors
        raise Tau2Error(f"{db_path}: not a {db_class.__name__} database: {error}") from None
    try:
        get_environment().get_tools()  # the tools' schemas come from their signatures
    except Exception as error:
        raise Tau2Error(
            f"{_location(error, directory, directory / TOOLS)}: cannot build the "
            f"tau2 domain {name!r}: {type(error).__name__}: {error}"
        ) from None
    return get_environment


def _import_package(package: str, directory: Path) -> None:
    """``package``: a package of its own whose modules are the files of ``directory``."""
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(directory)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    setattr(sys.modules[PACKAGE], package.rpartition(".")[2], module)


def _import(module: str, directory: Path, file: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as error:
        raise Tau2Error(
            f"{_location(error, directory, directory / file)}: cannot import the "
            f"tau2 domain's {file}: {type(error).__name__}: {error}"
        ) from None


def _forget(package: str) -> None:
    """Undo a registration that failed: drop the package and whatever of it was imported."""
    for module in [key for key in sys.modules if key == package or key.startswith(package + ".")]:
        del sys.modules[module]
    parent, _, name = package.rpartition(".")
    if hasattr(sys.modules[parent], name):
        delattr(sys.modules[parent], name)


def _location(error: BaseException, directory: Path, default: Path) -> str:
    """Where in the domain's own files ``error`` was raised (``file:line``), else ``default``."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if Path(frame.filename).parent == directory
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(default)


def _single_subclass(module: Any, base: type, file: Path) -> type:
    found = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, base)
        and value is not base
        and value.__module__ == module.__name__
    ]
    if len(found) != 1:
        names = ", ".join(cls.__name__ for cls in found) or "none"
        raise Tau2Error(
            f"{file}: a tau2 domain's {file.name} defines exactly one "
            f"{base.__name__} subclass; found {names}"
        )
    return found[0]


def _directory_tasks(directory: Path) -> list[Any]:
    """The tasks of a domain directory: its ``tasks.json``, tau2 tasks as tau2 writes them."""
    file = directory / TASKS_FILE
    if not file.is_file():
        raise Tau2Error(
            f"tau2 domain {directory.name!r} has no tasks: no {file}; name a task file in env.path"
        )
    return tau2_tasks(read_records(file))
