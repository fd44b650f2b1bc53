"""The folder tree is the architecture: imports between fleetlike's layers point down, never in a circle.

Every module of the package is read with `ast` (nothing is imported), and every import of a
fleetlike module counts: module level, inside functions, and under ``if TYPE_CHECKING:`` (a
type-only import is still a dependency a reader has to follow, and the first step of a real
circle). Imports of other packages are not looked at.

Layers, bottom up (`LAYERS`); a layer may import the layers listed for it, by default every
layer below it:

====================  =========================================================================
config                `DistributedStrategy`, the registry, the rules, the environment table,
                      the reductions every layer names (`ReduceOp`): nothing of fleetlike
roles                 who am I: role makers and the frozen `Role`
comm                  communicators over roles
collectives           buckets, reducer, flat / hierarchical / compressed averaging (comm only)
program               `Program`, `Executor`
strategies            one unit per feature (config, collectives, program, comm, roles); the
                      slow-rank report every face uses (`health.SlowRankWindow`)
ddp                   PyTorch DDP's face: communication hooks from a strategy, ``ddp.auto`` (the
                      zero-code-change patch) and its env knobs (config, collectives, comm, roles,
                      strategies: the data-parallel collective and the slow-rank helpers)
pipeline              pipeline parallelism: stages, the dp x pp groups, torch's schedules, stage
                      checkpoints (config, collectives, comm, roles, program, strategies: the
                      data-parallel collective, AMP's autocast, recompute)
fleet                 the facade of API.md and Paddle's aliases (``fleet.mixed_precision``'s
                      ``decorate``, ``fleet.role_maker``) (everything below)
elastic               fault tolerance with Horovod Elastic's names: State, commit/restore, run
                      (fleet for the world it re-forms; everything below)
plan                  the strategy planner: builds each strategy's real programs over dry
                      communicators and costs them, and predicts pipelines from the stages
                      ``pipeline.split`` makes (everything below but mixed_precision)
horovod               ``import fleetlike.horovod as hvd`` and Light's names (``horovod.light``,
                      ``light_init``): the Horovod face over fleet's communicators and the reducer
                      (everything below)
io                    data input: samplers, loaders, caches, datasets (fleet for the job's rank,
                      size and device; records data waits into strategies.health)
launch                the launcher: the environment table of config, the public names of roles, and of comm (the launcher hosts
                      the rendezvous store with --started_port=auto)
top                   ``fleetlike/__init__.py`` (the faces other than Fleet's on first use),
                      the shims that keep the old import paths (``auto``, ``cc``, ``calc``,
                      ``mixed_precision``, ``role_maker``: each the same module object as the face's
                      own), ``testing`` (test helper that builds roles and worlds); nothing in the
                      package imports them
====================  =========================================================================
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import fleetlike

ROOT = Path(fleetlike.__file__).resolve().parent

#: old import paths kept at the root: module -> the face's module it is (the same object)
SHIMS = {"auto": "fleetlike.ddp.auto", "cc": "fleetlike.horovod.light", "calc": "fleetlike.horovod.light_calc",
         "mixed_precision": "fleetlike.fleet.mixed_precision", "role_maker": "fleetlike.fleet.role_maker",
         "epl": "fleetlike.fleet.epl", "adaptfp16": "fleetlike.strategies.amp_policy",
         "tiacc_torch_warp": "fleetlike.strategies.amp_policy"}
#: the faces, each a package over the core
FACES = ("ddp", "fleet", "horovod")
#: what ``import fleetlike`` may load (at module level, transitively): the core and Fleet's face
EAGER_LAYERS = {"config", "roles", "comm", "collectives", "program", "tune", "strategies", "fleet", "top"}

#: bottom up: (layer, module prefixes, the layers it may import or None for "every layer below")
LAYERS: list[tuple[str, tuple[str, ...], set[str] | None]] = [
    ("config", ("fleetlike.config",), set()),
    ("roles", ("fleetlike.roles",), None),
    ("comm", ("fleetlike.comm",), None),
    ("collectives", ("fleetlike.collectives",), {"comm"}),
    ("program", ("fleetlike.program",), None),
    ("tune", ("fleetlike.tune",), {"config", "comm"}),
    ("strategies", ("fleetlike.strategies",), {"config", "collectives", "program", "comm", "roles", "tune"}),
    ("ddp", ("fleetlike.ddp",), {"config", "collectives", "comm", "roles", "strategies", "tune"}),
    ("pipeline", ("fleetlike.pipeline",), {"config", "collectives", "comm", "roles", "program", "strategies"}),
    ("fleet", ("fleetlike.fleet",), None),
    ("elastic", ("fleetlike.elastic",), None),
    ("plan", ("fleetlike.plan",), {"config", "roles", "comm", "collectives", "program", "strategies", "pipeline", "fleet"}),
    ("horovod", ("fleetlike.horovod",), None),
    ("io", ("fleetlike.io",), None),
    ("launch", ("fleetlike.launch",), {"config", "roles", "comm"}),
    ("top", ("fleetlike", *(f"fleetlike.{shim}" for shim in SHIMS), "fleetlike.testing"), None),
]

#: layers whose modules others may import only through the package (its public names)
PUBLIC_ONLY: dict[str, set[str]] = {"launch": {"roles", "comm"}}

# ------------------------------------------------------------------------------ reading


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(source: str, name: str) -> Iterator[tuple[str, int, str | None]]:
    """``(fleetlike module, line, name imported from it)`` for every import in ``source`` (the
    text of module ``name``), at any depth: module level, in functions, under TYPE_CHECKING.

    ``from a.b import c`` names the module ``a.b.c`` when there is one (importing a submodule),
    else ``a.b`` with the name ``c`` (a name from the package)."""
    package = name if name in MODULES and _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                if sub in MODULES:
                    yield sub, node.lineno, None
                elif origin in MODULES:
                    yield origin, node.lineno, alias.name


IMPORTS: dict[str, list[tuple[str, int, str | None]]] = {
    m: [i for i in _imports(p.read_text(encoding="utf-8"), m) if i[0] != m] for m, p in MODULES.items()
}
#: module -> {imported module: first line}
GRAPH: dict[str, dict[str, int]] = {
    m: {t: min(line for t2, line, _ in found if t2 == t) for t, _, _ in found} for m, found in IMPORTS.items()
}


def _layer(module: str) -> str:
    best, length = "", -1
    for layer, prefixes, _ in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = layer, len(prefix)
    return best


def _allowed(layer: str) -> set[str]:
    names = [entry[0] for entry in LAYERS]
    allowed = LAYERS[names.index(layer)][2]
    return set(names[: names.index(layer)]) if allowed is None else allowed


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, dict[str, int]], start: str, goal: str, within: set[str]) -> list[str]:
    """A shortest import path from ``start`` to ``goal`` inside ``within`` (for messages)."""
    previous: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, {})):
            if w in within and w not in previous:
                previous[w] = v
                queue.append(w)
    if goal not in previous:
        return []
    path = [goal]
    while previous[path[-1]] is not None:
        path.append(previous[path[-1]])  # type: ignore[arg-type]
    return path[::-1]


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    first = component[0]
    members = set(component)
    for w in sorted(graph[first]):
        if w in members:
            back = _path(graph, w, first, members)
            if back:
                loop = [first, *back]
                return " -> ".join(
                    f"{a} (line {graph[a][b]})" for a, b in zip(loop, loop[1:])
                ) + f" -> {first}"
    return ", ".join(component)


# --------------------------------------------------------------------------------- tests


def test_every_module_has_a_layer() -> None:
    assert {m: _layer(m) for m in MODULES if not _layer(m)} == {}


def _breaches() -> list[tuple[str, str, str]]:
    """``(importer, imported, why)`` for every import against the layering."""
    wrong = []
    for module, found in sorted(IMPORTS.items()):
        layer = _layer(module)
        for target, line, name in found:
            other = _layer(target)
            if other == layer:
                continue
            if other not in _allowed(layer):
                wrong.append((module, target, f"{module}:{line} imports {target}: layer {layer!r} "
                              f"may import {sorted(_allowed(layer)) or 'nothing of fleetlike'}, "
                              f"not {other!r}"))
            elif other in PUBLIC_ONLY.get(layer, set()) and (
                not _is_package(target) or (name or "").startswith("_")
            ):
                what = target if name is None else f"{name} from {target}"
                wrong.append((module, target, f"{module}:{line} imports {what}: layer {layer!r} "
                              f"may use only the public names of the {other!r} package"))
    return wrong


def test_imports_point_down_the_layers() -> None:
    wrong = [why for _, _, why in _breaches()]
    assert wrong == [], "imports against the layering:\n  " + "\n  ".join(wrong)


def test_no_import_circles_between_modules() -> None:
    circles = [_describe(GRAPH, c) for c in _cycles(GRAPH)]
    assert circles == [], "import circles between fleetlike modules:\n  " + "\n  ".join(circles)


def test_the_checker_sees_what_it_must() -> None:
    """Function-level, TYPE_CHECKING and relative imports count; cycles are reported as loops."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _describe(graph, ["a", "b", "c"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n    from fleetlike.fleet.facade import Fleet\n"
        "def f():\n    from fleetlike.comm import Communicator\n"
        "from . import flat\n"
        "from ..config import rules\n"
    )
    assert sorted(_imports(source, "fleetlike.collectives.reducer")) == [
        ("fleetlike.collectives.flat", 7, None),
        ("fleetlike.comm", 6, "Communicator"),
        ("fleetlike.config.rules", 8, None),
        ("fleetlike.fleet.facade", 4, "Fleet"),
    ]
    assert _layer("fleetlike.collectives.reducer") == "collectives"
    assert _layer("fleetlike.testing") == "top" and _layer("fleetlike") == "top"
    assert _allowed("config") == set() and _allowed("collectives") == {"comm"}
    assert _allowed("fleet") >= {"strategies", "program", "ddp"}


def _module_level_imports(name: str) -> set[str]:
    """The fleetlike modules ``name`` imports when it is imported: statements outside functions
    and classes, and not under ``if TYPE_CHECKING:``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(t for t, _, _ in _imports(ast.unparse(node), name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])

    visit(tree.body)
    return found - {name}


def _loaded_by(name: str) -> set[str]:
    """Every fleetlike module importing ``name`` loads (packages above a module included)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]
        todo += sorted(_module_level_imports(m))
    return seen


def test_each_face_is_a_package_over_the_core_and_the_root_holds_only_shims() -> None:
    for face in FACES:
        assert _is_package(f"fleetlike.{face}"), face
        # a face reuses the core (and Horovod's builds on fleet's communicators), never the root
        below = {_layer(t) for m in MODULES if _layer(m) == face for t, _, _ in IMPORTS[m]} - {face}
        assert "top" not in below and below <= _allowed(face), (face, below)
    root = {m for m in MODULES if m.count(".") == 1 and not _is_package(m)}
    assert root == {f"fleetlike.{s}" for s in SHIMS} | {"fleetlike.testing"}
    for shim, target in SHIMS.items():
        text = MODULES[f"fleetlike.{shim}"].read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 15 and "sys.modules[__name__] = _module" in text, shim
        assert _module_level_imports(f"fleetlike.{shim}") == {target}, shim


def test_import_fleetlike_loads_the_core_and_fleet_only() -> None:
    loaded = _loaded_by("fleetlike")
    assert {_layer(m) for m in loaded} <= EAGER_LAYERS, sorted(m for m in loaded if _layer(m) not in EAGER_LAYERS)
    # the other faces come on first use, by their documented names
    assert set(fleetlike._LAZY) == {"adaptfp16", "calc", "cc", "init_process_group", "io", "light_init",
                                    "mixed_precision", "role_maker", "tiacc_torch_warp"}
