"""The public API as a user meets it: every public module's ``__all__`` names what it exports
(each name exists, none twice, and a star import gives exactly those); the names of the
user-facing contract (shared/API.md, beside the repository) import from where it says; and the
version is the same in setup.cfg, the package and the changelog's latest release."""

from __future__ import annotations

import ast
import configparser
import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path

import pytest

import fleetlike

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT.parent / "shared" / "API.md"
#: importing it patches torch's DistributedDataParallel for the whole process, so it is read,
#: not imported
PATCHES_ON_IMPORT = {"fleetlike.ddp.auto"}
#: root shims binding an old import path to a face's module (tests/test_layers.py checks that
#: each is that module); fleetlike.auto is ddp.auto under its documented name, read above
SHIM_OF_PATCHING = {"fleetlike.auto": "fleetlike.ddp.auto"}


def _public_modules() -> list[str]:
    names = ["fleetlike"]
    for info in pkgutil.walk_packages(fleetlike.__path__, "fleetlike."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


PUBLIC = _public_modules()


def test_the_walk_finds_the_packages_of_the_contract() -> None:
    for name in ("fleetlike.fleet", "fleetlike.roles", "fleetlike.strategies", "fleetlike.launch",
                 "fleetlike.comm", "fleetlike.horovod", "fleetlike.io", "fleetlike.auto"):
        assert name in PUBLIC, name


@pytest.mark.parametrize("name", [n for n in PUBLIC if n not in PATCHES_ON_IMPORT and n not in SHIM_OF_PATCHING])
def test_all_names_what_the_module_exports(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert all(isinstance(n, str) for n in exported), name
    assert len(set(exported)) == len(exported), f"{name}.__all__ names something twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module does not have: {missing}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # noqa: S102 - the star import a user would write
    assert set(namespace) - {"__builtins__"} == set(exported), name


@pytest.mark.parametrize("name", sorted(PATCHES_ON_IMPORT))
def test_all_of_a_patching_module_names_its_top_level_definitions(name: str) -> None:
    path = Path(importlib.util.find_spec(name).origin)
    tree = ast.parse(path.read_text())
    defined: set[str] = set()
    exported: list[str] | None = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defined.add(t.id)
                    if t.id == "__all__":
                        exported = ast.literal_eval(node.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    assert exported is not None, f"{name} has no __all__"
    assert not set(exported) - defined, f"{name}.__all__ names undefined {set(exported) - defined}"


# ---------------------------------------------------------------------------- shared/API.md


def _contract() -> str:
    if not API_MD.is_file():
        pytest.skip(f"the contract {API_MD} is not beside this checkout")
    return API_MD.read_text()


def _section(text: str, number: int) -> str:
    start = text.index(f"\n## {number}.")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _resolve(path: str, roots: dict[str, object]) -> object:
    """The object ``path`` names, looked up without running properties that need a job (the
    facade's ``fleet.main_program`` exists before ``minimize`` and raises until then): a
    property stands for the type its getter returns."""
    head, *rest = path.split(".")
    obj = roots[head]
    for part in rest:
        try:
            found = inspect.getattr_static(obj, part)
        except AttributeError:
            raise AssertionError(f"API.md's `{path}`: {obj!r} has no {part!r}") from None
        if isinstance(found, property):
            hints = typing.get_type_hints(found.fget)
            obj = hints.get("return", found)
        else:
            obj = getattr(obj, part)
    return obj


def test_the_contracts_imports_run() -> None:
    text = _contract()
    lines = [ln.split("#")[0].strip() for ln in _section(text, 1).splitlines()]
    imports = [ln for ln in lines if re.match(r"(import|from) fleetlike", ln)]
    assert len(imports) >= 3, imports
    for line in imports:
        exec(line, {})  # noqa: S102 - each import line of the contract, as a user writes it
    import fleetlike.role_maker as role_maker
    from fleetlike import roles
    for name in dir(roles):
        if name.endswith("RoleMaker"):
            assert getattr(role_maker, name) is getattr(roles, name)


def test_the_contracts_names_exist_where_it_says() -> None:
    text = _contract()
    from fleetlike import DistributedStrategy, fleet, roles
    from fleetlike.fleet import DistributedOptimizer
    roots = {"fleet": fleet, "roles": roles, "fleetlike": fleetlike, "s": DistributedStrategy(),
             "DistributedOptimizer": DistributedOptimizer, "opt": DistributedOptimizer,
             "exe": fleetlike.Executor, "DistributedStrategy": DistributedStrategy}
    seen = set()
    for path in re.findall(r"(?<![\w.])((?:fleet|roles|fleetlike|s|opt|exe|DistributedOptimizer|"
                           r"DistributedStrategy)(?:\.\w+)+)", text):
        path = path.rstrip(".")
        if path.startswith("fleetlike.") and path.split(".")[1] in {"launch", "strategies",
                                                                    "roles", "comm", "role_maker"}:
            importlib.import_module(path)  # packages the contract names
            seen.add(path)
            continue
        _resolve(path, roots)
        seen.add(path)
    for expected in ("fleet.distributed_optimizer", "fleet.main_program", "fleet.util.all_reduce",
                     "roles.PaddleCloudRoleMaker", "s.localsgd_configs", "fleetlike.Executor"):
        assert expected in seen, expected
    # every role maker answers the questions section 2 lists
    questions = re.findall(r"`(\w+)\(\)`", _section(text, 2).split("Every role maker answers:")[1]
                           .split("\n\n")[0])
    assert "worker_index" in questions
    for maker in ("PaddleCloudRoleMaker", "UserDefinedRoleMaker", "UserDefinedCollectiveRoleMaker",
                  "MPIRoleMaker", "EnvRoleMaker"):
        for q in questions:
            assert callable(getattr(getattr(roles, maker), q, None)), (maker, q)
    # Fleet 1.x's aliases (section 3) are settings of the same strategy
    aliases = re.findall(r"`(\w+)`(?: \(=|,)", _section(text, 3).split("Fleet 1.x names")[1]
                         .split("\n\n")[0])
    assert "use_local_sgd" in aliases
    for alias in aliases:
        assert hasattr(DistributedStrategy(), alias), alias


def test_the_contracts_launcher_flags_are_accepted() -> None:
    text = _contract()
    from fleetlike.launch.flags import build_parser
    known = {s for a in build_parser()._actions for s in a.option_strings}
    # what follows the script's name on a command line is the script's own (``train.py --lr``)
    launcher_part = "\n".join(re.split(r"\S+\.py\b", ln)[0] for ln in _section(text, 5).splitlines())
    flags = set(re.findall(r"(--[a-z_]+)", launcher_part))
    assert {"--cluster_node_ips", "--nproc_per_node", "--log_dir", "--ips"} <= flags
    assert not flags - known, f"flags of API.md the launcher does not accept: {flags - known}"


# ---------------------------------------------------------------------------- version


def test_one_version_everywhere() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    version = cfg["metadata"]["version"]
    assert fleetlike.__version__ == version
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$",
                          (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version, (releases, version)
