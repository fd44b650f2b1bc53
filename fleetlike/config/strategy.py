"""`DistributedStrategy`: the typed, validated, round-trippable configuration of a training job.

Paddle names and defaults, but unlike Paddle nothing is silently ignored:

* an unknown attribute raises `UnknownAttributeError` (an ``AttributeError``), an unknown key in a
  dict raises `UnknownOptionError` (a ``KeyError`` that is also a ``ValueError``), both with the
  nearest valid name;
* a wrong type raises `StrategyTypeError` (``TypeError``; a bool is not an int here), a bad value
  `StrategyValueError` (``ValueError``); each message names the field, the constraint, the value
  and the fix;
* every update is all-or-nothing: a rejected assignment leaves the strategy exactly as it was.

Config sections (``amp_configs`` ...) read as a live, validated mapping (`ConfigSection`):
``s.amp_configs["dtype"] = "bfloat16"`` writes through with validation, and
``s.amp_configs = {"init_loss_scaling": 1024}`` changes only the keys given. List values are
returned as tuples, so ``s.amp_configs["custom_white_list"].append(...)`` fails loudly instead
of editing a throw-away copy.

Example:
    >>> s = DistributedStrategy()
    >>> s.localsgd = True
    >>> s.localsgd_configs = {"k_steps": 4}
    >>> s.local_sgd_steps                      # Fleet 1.x alias of the same storage
    4
    >>> DistributedStrategy.from_dict({"localsgd": True, "localsgd_configs.k_steps": 4}) == s
    True

The environment variable `STRATEGY_ENV_VAR` may hold JSON or a path to a JSON file; this module
never reads the environment itself (the fleet layer does, and calls `update_from_override`).
"""

from __future__ import annotations

import copy as _copy
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from fleetlike.config import envvars, rules
from fleetlike.config.fields import (
    Field,
    Section,
    StrategyTypeError,
    StrategyValueError,
    UnknownAttributeError,
    plain,
    suggest,
    type_error,
    unknown_key,
)
from fleetlike.config.aliases import ALIASES
from fleetlike.config.options import ENTRIES
from fleetlike.config.formats import (
    describe_option,
    known_names,
    render_markdown,
    render_table,
)
from fleetlike.config.view import ConfigSection

__all__ = ["STRATEGY_ENV_VAR", "ConfigSection", "DistributedStrategy", "InactiveSetting"]

#: Name of the environment variable whose JSON (or JSON file path) overrides a strategy. Read by
#: the fleet layer only; pass its value to `DistributedStrategy.update_from_override`.
STRATEGY_ENV_VAR = envvars.STRATEGY

_SCALARS: dict[str, Field] = {e.name: e for e in ENTRIES if isinstance(e, Field)}
_SECTIONS: dict[str, Section] = {e.name: e for e in ENTRIES if isinstance(e, Section)}
_ALIASES = {a.name: a for a in ALIASES}
_ATTRS = frozenset([*_SCALARS, *_SECTIONS, *_ALIASES])
#: every canonical dotted path, in display order
_PATHS: tuple[str, ...] = tuple(
    p for e in ENTRIES for p in ([e.name] if isinstance(e, Field) else [f"{e.name}.{f.name}" for f in e.fields]))


class InactiveSetting(NamedTuple):
    """A setting that is recorded but cannot have an effect, and why (for a one-time warning)."""

    name: str
    value: Any
    reason: str


class _Update(NamedTuple):
    path: str  # canonical: "amp" or "amp_configs.dtype"
    value: Any
    label: str  # as the user spelled it, for messages
    key: str  # the top-level key it came from, for duplicate detection


def _section_items(section: Section, value: Any, label: str) -> Mapping[Any, Any]:
    """The key/value pairs to assign to ``section``: a mapping, or an object's attributes."""
    if isinstance(value, Mapping):
        return value
    if section.from_object and not isinstance(value, (str, bytes, int, float, list, tuple)):
        found = {k: getattr(value, k) for k in section.keys() if hasattr(value, k)}
        if found:
            return found
    example = {section.fields[0].name: plain(section.fields[0].default)}
    extra = " or an object with those attributes" if section.from_object else ""
    raise type_error(label, value, f"a dict with keys among {section.keys()}{extra}",
                     f"assign a dict such as {example}; only the keys given change")


def _expand(key: Any, value: Any, label: str | None = None, source: str | None = None
            ) -> list[_Update]:
    """Turn one user-written ``key: value`` into canonical updates (values not yet validated).

    ``label`` is how messages name the option; ``source`` is the key as the user wrote it, so
    that two spellings of the same option in one dict can be detected.
    """
    if not isinstance(key, str):
        raise type_error("option name", key, "a str", "use option names as strings")
    label, source = label or key, source or key
    dotted = _ALIASES.get(key) if "." in key else None  # EPL's dotted names ("zero.level")
    if dotted is not None and dotted.target is not None:
        return _expand(dotted.target, value, f"{key} (= {dotted.target})", source)
    if dotted is not None and dotted.spec is not None and dotted.write is not None:
        chosen = dotted.spec.check(label, value)
        return [_Update(p, v, f"{label} (-> {p})", source) for p, v in dotted.write(chosen).items()]
    head, dot, tail = key.partition(".")
    alias = _ALIASES.get(head)
    if alias is not None and alias.target is not None:
        target = alias.target + (dot + tail if dot else "")
        shown = label if alias.target in _SECTIONS else f"{key} (= {target})"
        return _expand(target, value, shown, source)
    if alias is not None and not dot and alias.spec is not None and alias.write is not None:
        chosen = alias.spec.check(label, value)  # derived alias: validate, then write through
        return [_Update(p, v, f"{label} (-> {p})", source) for p, v in alias.write(chosen).items()]
    section = _SECTIONS.get(head)
    if dot:
        if section is None:
            raise unknown_key(key, known_names(), "DistributedStrategy")
        if section.field(tail) is None:
            raise unknown_key(tail, section.keys(), label.rsplit(".", 1)[0])
        return [_Update(key, value, label, source)]
    if head in _SCALARS:
        return [_Update(head, value, label, source)]
    if section is not None:
        updates = []
        for sub, sub_value in _section_items(section, value, label).items():
            if not isinstance(sub, str) or section.field(sub) is None:
                raise unknown_key(sub, section.keys(), label)
            updates.append(_Update(f"{head}.{sub}", sub_value, f"{label}.{sub}", source))
        return updates
    raise unknown_key(key, known_names(), "DistributedStrategy")


class DistributedStrategy:
    """What the fleet layer should do to a training step, with Paddle 2.x names and defaults.

    Every option is a validated attribute generated from the registry in `options`;
    ``DistributedStrategy.describe(name)`` gives its constraint, default and tuning note, and
    ``print(strategy)`` a table of everything. Keyword arguments are applied like `update`::

        s = DistributedStrategy(amp=True, amp_configs={"dtype": "bfloat16"})
    """

    __slots__ = ("_values", "_explicit")
    _values: dict[str, Any]
    #: canonical paths ("amp", "amp_configs.dtype") the user assigned, even to their default
    _explicit: set[str]

    def __init__(self, **options: Any) -> None:
        values: dict[str, Any] = {}
        for entry in ENTRIES:
            if isinstance(entry, Field):
                values[entry.name] = entry.default
            else:
                values[entry.name] = {f.name: f.default for f in entry.fields}
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_explicit", set())
        if options:
            self.update(options)

    # ------------------------------------------------------------------ attribute machinery

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _ATTRS:
            raise self._unknown_attribute(name)
        object.__setattr__(self, name, value)  # the generated property validates

    def __getattr__(self, name: str) -> Any:  # only reached when normal lookup failed
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._unknown_attribute(name)

    @staticmethod
    def _unknown_attribute(name: str) -> UnknownAttributeError:
        near = suggest(name, sorted(_ATTRS))
        fix = (f"did you mean {near!r}?" if near else
               "see DistributedStrategy.option_names() and DistributedStrategy.aliases()")
        return UnknownAttributeError(name, name, "a known option", fix,
                                     f"DistributedStrategy has no option {name!r}. Fix: {fix}")

    def _get(self, path: str) -> Any:
        head, dot, tail = path.partition(".")
        return self._values[head][tail] if dot else self._values[head]

    def _read(self, name: str) -> Any:
        alias = _ALIASES.get(name)
        if alias is not None:
            if alias.target is None:
                assert alias.read is not None  # registry invariant
                return alias.read(self._get)
            name = alias.target
        if name in _SECTIONS:
            return ConfigSection(self, name)
        return self._get(name)

    # ---------------------------------------------------------------------------- updates

    def update(self, options: Mapping[str, Any]) -> None:
        """Apply ``options`` all-or-nothing: nested or flat dotted keys, canonical or 1.x names.

        Sections given as dicts change only the keys given. A key and its alias (``localsgd``
        and ``use_local_sgd``) may not both appear: which one wins would be a guess.
        """
        if not isinstance(options, Mapping):
            raise type_error("strategy options", options, "a dict of option name -> value",
                             "pass a dict such as {'amp': True, 'localsgd_configs.k_steps': 4}")
        updates: list[_Update] = []
        for key, value in options.items():
            updates.extend(_expand(key, value))
        self._apply(updates)

    def _apply(self, updates: list[_Update]) -> None:
        seen: dict[str, _Update] = {}
        staged: dict[str, Any] = {}
        for u in updates:
            if u.path in seen and seen[u.path].key != u.key:
                first = seen[u.path]
                msg = (f"{first.key!r} and {u.key!r} both set {u.path}. Fix: keep only one of "
                       "them (one is an alias of the other)")
                raise StrategyValueError(u.path, u.value, "set once", "keep only one", msg)
            seen[u.path] = u
            head, dot, tail = u.path.partition(".")
            field = _SECTIONS[head].field(tail) if dot else _SCALARS[head]
            assert field is not None  # _expand only produces registered paths
            staged[u.path] = field.spec.check(u.label, u.value)
        merged_sections: dict[str, dict[str, Any]] = {}
        for path, value in staged.items():
            head, dot, tail = path.partition(".")
            if dot:
                merged_sections.setdefault(head, dict(self._values[head]))[tail] = value
        for name, merged in merged_sections.items():
            check = _SECTIONS[name].check
            if check is not None:
                check(name, merged)
        for path, value in staged.items():  # validated: commit
            if "." not in path:
                self._values[path] = value
        self._values.update(merged_sections)
        self._explicit.update(staged)

    def reset(self, name: str | None = None) -> None:
        """Restore the default of ``name`` (an option, a section, ``"section.key"`` or an alias
        with a target), or of every option when ``name`` is None."""
        if name is None:
            object.__setattr__(self, "_values", DistributedStrategy()._values)
            self._explicit.clear()
            return
        alias = _ALIASES.get(name)
        target = alias.target if alias is not None else name
        if target is None:
            fix = "reset localsgd and adaptive_localsgd instead"
            raise StrategyValueError(name, name, "an option with stored state", fix,
                                     f"{name} is derived from other options. Fix: {fix}")
        if target in _SECTIONS:
            paths = [f"{target}.{k}" for k in _SECTIONS[target].keys()]
        else:
            paths = [u.path for u in _expand(target, None)]
        fresh = DistributedStrategy()
        self._apply([_Update(p, fresh._get(p), p, p) for p in paths])
        self._explicit.difference_update(paths)  # back to the default: free again (the tuner's)

    # ------------------------------------------------------------------ what the user set

    def explicit_options(self) -> list[str]:
        """The options assigned since the strategy was made, even to their default value, as
        canonical dotted paths in display order (``update``, attribute and section writes,
        ``from_dict``, ``FLEETLIKE_STRATEGY`` and the environment knobs all count; `reset`
        frees an option again). The online tuner never changes one of these.

        Example:
            >>> s = DistributedStrategy(fuse_grad_size_in_MB=32)   # the default, written out
            >>> s.explicit_options(), s == DistributedStrategy()
            (['fuse_grad_size_in_MB'], True)
        """
        return [p for p in _PATHS if p in self._explicit]

    def is_explicit(self, name: str) -> bool:
        """Whether ``name`` (an option, ``"section.key"``, a whole section or a 1.x alias) was
        assigned; a section counts when any of its keys was."""
        alias = _ALIASES.get(name)
        if alias is not None:
            paths = [alias.target] if alias.target is not None else list(alias.touches)
        else:
            paths = [name]
        for path in paths:
            if path not in _SCALARS and path not in _SECTIONS and path.partition(".")[0] not in _SECTIONS:
                raise unknown_key(name, known_names(), "DistributedStrategy")
        return any(p in self._explicit or (p in _SECTIONS and any(e.startswith(p + ".") for e in self._explicit))
                   for p in paths)

    # ------------------------------------------------------------------------ round trips

    def to_dict(self, flat: bool = False, non_default_only: bool = False) -> dict[str, Any]:
        """JSON-ready canonical options (no 1.x aliases), nested or flat ``"section.key"``.

        ``non_default_only`` keeps what differs from Paddle's defaults: a compact form for
        logs and for the environment override.
        """
        out: dict[str, Any] = {}
        for entry in ENTRIES:
            if isinstance(entry, Field):
                value = self._values[entry.name]
                if not (non_default_only and value == entry.default):
                    out[entry.name] = entry.spec.to_plain(value)
                continue
            section = {
                f.name: f.spec.to_plain(self._values[entry.name][f.name])
                for f in entry.fields
                if not (non_default_only and self._values[entry.name][f.name] == f.default)
            }
            if flat:
                out.update({f"{entry.name}.{k}": v for k, v in section.items()})
            elif section or not non_default_only:
                out[entry.name] = section
        return out

    @classmethod
    def from_dict(cls, options: Mapping[str, Any], explicit: Iterable[str] | None = None) -> DistributedStrategy:
        """A strategy from defaults updated by ``options`` (any form `update` accepts). Every
        option given counts as set by the user (`explicit_options`), unless ``explicit`` names
        the ones that do (canonical dotted paths, as `explicit_options` returns them)."""
        strategy = cls()
        strategy.update(options)
        if explicit is not None:
            names = set(explicit)
            bad = sorted(names - set(_PATHS))
            if bad:
                raise unknown_key(bad[0], known_names(), "DistributedStrategy")
            object.__setattr__(strategy, "_explicit", names)
        return strategy

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_dict()`` as JSON; `load` reads it back to an equal strategy."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DistributedStrategy:
        """Read a strategy saved by `save` (or any JSON object of options)."""
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        return cls.from_dict(_parse_json(text, f"strategy file {os.fspath(path)!r}"))

    @classmethod
    def from_json_or_path(cls, text: str) -> DistributedStrategy:
        """A strategy from JSON text or from the path of a JSON file (``FLEETLIKE_STRATEGY``)."""
        strategy = cls()
        strategy.update_from_override(text)
        return strategy

    def update_from_override(self, text: str) -> None:
        """Apply an override held as JSON text (starting with ``{``) or a JSON file path.

        This is what the fleet layer calls with the value of `STRATEGY_ENV_VAR`; like `update`
        it is all-or-nothing and changes only the options named.
        """
        if not isinstance(text, str):
            raise type_error(STRATEGY_ENV_VAR, text, "a str: JSON text or a file path",
                             "pass the variable's string value")
        stripped = text.strip()
        if stripped.startswith("{"):
            self.update(_parse_json(stripped, f"{STRATEGY_ENV_VAR} JSON"))
            return
        path = os.path.expanduser(stripped)
        if not stripped or not os.path.isfile(path):
            fix = "set it to a JSON object such as '{\"amp\": true}' or to an existing JSON file"
            raise StrategyValueError(
                STRATEGY_ENV_VAR, text, "JSON text or the path of a JSON file", fix,
                f"{STRATEGY_ENV_VAR} must hold JSON text (starting with '{{') or the path of an "
                f"existing file, got {text!r}. Fix: {fix}")
        with open(path, encoding="utf-8") as fh:
            self.update(_parse_json(fh.read(), f"{STRATEGY_ENV_VAR} file {path!r}"))

    # ------------------------------------------------------------- value semantics

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # type: ignore[assignment]  # mutable

    def copy(self) -> DistributedStrategy:
        """An independent strategy with equal values."""
        clone = DistributedStrategy()
        object.__setattr__(clone, "_values", _copy.deepcopy(self._values))
        object.__setattr__(clone, "_explicit", set(self._explicit))
        return clone

    def __copy__(self) -> DistributedStrategy:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedStrategy:
        return self.copy()

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], list[str]]]:
        # the values as to_dict gives them, and which of them the user set (not all of them)
        return (_restore, (self.to_dict(), self.explicit_options()))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict(non_default_only=True).items())
        return f"DistributedStrategy({args})"

    def __str__(self) -> str:
        return render_table(self.to_dict(flat=True), self.enabled_features(),
                            self.inactive_settings())

    # ---------------------------------------------------------------- for the fleet layer

    def enabled_features(self) -> list[str]:
        """Names of the top-level on/off switches that are on, in registry order.

        ``fuse_all_reduce_ops`` is on by default, so a fresh strategy gives
        ``["fuse_all_reduce_ops"]``. The order is display order, not pass order.
        """
        return [e.name for e in ENTRIES if isinstance(e, Field) and e.feature and
                self._values[e.name] is True]

    def inactive_settings(self) -> list[InactiveSetting]:
        """Settings that are recorded but have no effect, each with the reason and the fix.

        Three kinds: options that PyTorch cannot honour (``mode``, ``execution_strategy``) when
        changed from their default; non-default settings of a feature that is off (e.g.
        ``amp_configs.dtype`` with ``amp`` False); and ``recompute`` on with no checkpoints.
        The fleet layer warns once for each.
        """
        found: list[InactiveSetting] = []
        for entry in ENTRIES:
            if isinstance(entry, Field):
                items = [(entry.name, entry, self._values[entry.name])]
            else:
                items = [(f"{entry.name}.{f.name}", f, self._values[entry.name][f.name])
                         for f in entry.fields]
            changed = [(n, f, v) for n, f, v in items if v != f.default]
            if not changed:
                continue
            inert = entry.inert
            if inert and isinstance(entry, Section):
                plain = {n.split(".", 1)[1]: f.spec.to_plain(v) for n, f, v in changed}
                found.append(InactiveSetting(entry.name, plain, inert))
                continue
            for name, field, value in changed:
                if inert:
                    found.append(InactiveSetting(name, field.spec.to_plain(value), inert))
                elif (need := entry.requires if field is entry or field.requires is None else field.requires) \
                        and not self._values[need]:
                    found.append(InactiveSetting(
                        name, field.spec.to_plain(value),
                        f"{need} is False, so this has no effect; set {need} = True or leave the default"))
        if self._values["recompute"] and not self._values["recompute_configs"]["checkpoints"]:
            found.append(InactiveSetting(
                "recompute", True, "recompute_configs.checkpoints is empty, so nothing is "
                "recomputed; name submodules, e.g. ['encoder.0'], or use 'auto'"))
        return found

    def validate_combination(self) -> None:
        """Raise `StrategyValueError` for options that cannot work together (`rules.check`).

        Called by the fleet layer at ``distributed_optimizer``/``minimize`` time rather than on
        assignment, so that a user may switch one feature on before switching another off.
        """
        rules.check(self)

    def bucket_cap_bytes(self, params: Iterable[Any] | None = None) -> int | None:
        """Gradient bucket size in bytes (``fuse_grad_size_in_MB`` MiB), or None for one bucket
        per gradient (``fuse_all_reduce_ops`` False).

        The one place this conversion lives: data parallel, eager style and local SGD's
        averaging buffers all size their buckets from it, so they always agree. With
        ``fuse_grad_max_buckets`` N > 0 and the trainable ``params`` given, the size grows to
        ``ceil(bytes / N)`` plus the largest gradient where the MB size would make more than N
        buckets: a bucket closes only when the next gradient does not fit, so each closed one
        holds more than 1/N of the bytes and there are at most N (per dtype and device)."""
        if not self._values["fuse_all_reduce_ops"]:
            return None
        cap = int(float(self._values["fuse_grad_size_in_MB"]) * (1 << 20))
        most = int(self._values["fuse_grad_max_buckets"])
        if most > 0 and params is not None:
            sizes = [p.numel() * p.element_size() for p in params if p.requires_grad]
            total = sum(sizes)
            if total > most * cap:
                cap = -(-total // most) + max(sizes)
        return cap

    # ---------------------------------------------------------------- introspection

    @classmethod
    def describe(cls, name: str) -> str:
        """Constraint, default and tuning note for an option, section key or 1.x alias."""
        return describe_option(name)

    @classmethod
    def option_names(cls) -> list[str]:
        """Every canonical option as a flat dotted path, in display order."""
        return list(cls().to_dict(flat=True))

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """Fleet 1.x alias -> canonical path (or a description, for derived ones)."""
        return {a.name: a.target or a.note for a in ALIASES}

    @classmethod
    def options_markdown(cls) -> str:
        """Documentation table generated from the registry."""
        return render_markdown()


def _restore(options: dict[str, Any], explicit: list[str]) -> DistributedStrategy:
    """Unpickle: `__reduce__`'s values, with only the options the user set counted as set."""
    return DistributedStrategy.from_dict(options, explicit=explicit)


def _parse_json(text: str, source: str) -> Mapping[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StrategyValueError(source, text, "valid JSON", "fix the JSON syntax",
                                 f"{source} is not valid JSON ({exc}). Fix: correct the "
                                 "syntax") from None
    if not isinstance(data, dict):
        raise StrategyTypeError(source, data, "a JSON object", "wrap the options in {...}",
                                f"{source} must hold a JSON object of options, got "
                                f"{type(data).__name__}. Fix: wrap the options in {{...}}")
    return data


def _make_property(name: str) -> property:
    def fget(self: DistributedStrategy) -> Any:
        return self._read(name)

    def fset(self: DistributedStrategy, value: Any) -> None:
        self.update({name: value})

    return property(fget, fset, doc=describe_option(name))


for _name in sorted(_ATTRS):
    setattr(DistributedStrategy, _name, _make_property(_name))
del _name
