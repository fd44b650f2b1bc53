"""The vocabulary of the strategy registry: value specs, fields, sections, aliases and errors.

Why a registry instead of hand-written properties: Paddle's ``DistributedStrategy`` grew one
setter per option, and each setter validated (or forgot to validate) in its own way, so a typo or
a wrong type was often silently accepted. Here every option is one declarative `Field` whose
`Spec` knows how to check a value, describe its constraint and turn it back into JSON. The
strategy object, its printed table, its dict/JSON round trips and its documentation are all
derived from the same records, so they cannot drift apart.

Every error raised here names the field, the constraint, the value received and the fix::

    >>> Int(min=1).check("localsgd_configs.k_steps", 0)
    Traceback (most recent call last):
    ...
    fleetlike.config.fields.StrategyValueError: localsgd_configs.k_steps must be an int >= 1, \
got 0. Fix: use an int >= 1, e.g. 1.
"""

from __future__ import annotations

import abc

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any

from fleetlike.config.reductions import ReduceOp

__all__ = [
    "Alias",
    "Bool",
    "Checkpoints",
    "Choice",
    "Field",
    "Float",
    "Int",
    "Reduction",
    "Section",
    "Spec",
    "StrList",
    "StrategyError",
    "StrategyTypeError",
    "StrategyValueError",
    "UnknownAttributeError",
    "UnknownOptionError",
    "plain",
    "suggest",
    "unknown_key",
]


# --------------------------------------------------------------------------------------- errors


class StrategyError(Exception):
    """Base of every strategy configuration error; catch it to handle them all at once.

    Attributes carry the pieces of the message so that callers (the fleet layer's report, tests)
    need not parse text: ``field`` (dotted name as the user spelled it), ``value`` (what was
    received), ``constraint`` (what was expected) and ``fix`` (what to do instead).
    """

    def __init__(self, field: str, value: Any, constraint: str, fix: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.constraint = constraint
        self.fix = fix

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0])


class StrategyTypeError(StrategyError, TypeError):
    """A value of the wrong type (a bool where an int is expected counts as a wrong type)."""


class StrategyValueError(StrategyError, ValueError):
    """A value of the right type outside the allowed range or set, or options that clash."""


class UnknownOptionError(StrategyError, KeyError, ValueError):
    """An unknown key in a config section or in a dict given to ``from_dict``/``update``.

    It is a `KeyError` because sections behave like mappings, and also a `ValueError` because a
    dict read from a file or an environment variable is bad input data; either ``except`` works.
    """


class UnknownAttributeError(StrategyError, AttributeError):
    """An unknown attribute on a `DistributedStrategy` or a config section (a typo, usually)."""


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """Return the candidate nearest to ``name`` (case-insensitive), or None when none is close."""
    pool = list(candidates)
    lowered = {c.lower(): c for c in pool}
    hit = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hit[0]] if hit else None


def _show(value: Any) -> str:
    """``repr`` plus the type name: for a type error the type is the point (``1`` vs ``True``)."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def type_error(field: str, value: Any, constraint: str, fix: str) -> StrategyTypeError:
    """Build the uniform TypeError message."""
    msg = f"{field} must be {constraint}, got {_show(value)}. Fix: {fix}."
    return StrategyTypeError(field, value, constraint, fix, msg)


def value_error(field: str, value: Any, constraint: str, fix: str) -> StrategyValueError:
    """Build the uniform ValueError message."""
    msg = f"{field} must be {constraint}, got {value!r}. Fix: {fix}."
    return StrategyValueError(field, value, constraint, fix, msg)


def plain(value: Any) -> Any:
    """JSON-ready copy: enums to their value, tuples to lists, mappings to dicts."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def unknown_key(name: Any, candidates: list[str], where: str) -> UnknownOptionError:
    """The uniform unknown-name error, with the nearest candidate when one is close."""
    near = suggest(name, candidates) if isinstance(name, str) else None
    hint = f"did you mean {near!r}? " if near else ""
    shown = (f"valid names: {', '.join(candidates)}" if len(candidates) <= 12
             else "all names: DistributedStrategy.option_names() and .aliases()")
    fix = f"{hint}{shown}"
    return UnknownOptionError(str(name), name, f"a known {where} name", fix,
                              f"{where} has no option {name!r}. Fix: {fix}")


# ----------------------------------------------------------------------------------------- specs


class Spec(abc.ABC):
    """How one option's values are checked, described and serialised.

    ``check`` returns the normalised value to store (e.g. an int given for a float becomes a
    float, a list becomes a tuple so that a caller cannot mutate stored state behind the
    validator's back) or raises `StrategyTypeError` / `StrategyValueError`.
    """

    @abc.abstractmethod
    def check(self, field: str, value: Any) -> Any: ...

    @abc.abstractmethod
    def describe(self) -> str: ...

    def to_plain(self, value: Any) -> Any:
        """The JSON-ready form of a stored value."""
        return value


class Bool(Spec):
    """Exactly ``True`` or ``False``: 0/1 and strings such as "true" are rejected, not guessed."""

    def check(self, field: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise type_error(field, value, "a bool", "pass True or False")
        return value

    def describe(self) -> str:
        return "bool"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Int(Spec):
    """An integer in ``[min, max]``; bools are refused because ``True`` is almost always a slip."""

    min: int | None = None
    max: int | None = None

    def describe(self) -> str:
        parts = ["int"]
        if self.min is not None and self.max is not None:
            return f"int in [{self.min}, {self.max}]"
        if self.min is not None:
            parts.append(f">= {self.min}")
        if self.max is not None:
            parts.append(f"<= {self.max}")
        return " ".join(parts)

    def check(self, field: str, value: Any) -> int:
        if not _is_int(value):
            hint = " (bool is not accepted as an int here)" if isinstance(value, bool) else ""
            raise type_error(field, value, f"an {self.describe()}{hint}",
                             f"pass a whole number, e.g. {self._example()}")
        number = int(value)
        if (self.min is not None and number < self.min) or (
            self.max is not None and number > self.max
        ):
            raise value_error(field, number, f"an {self.describe()}",
                              f"use an {self.describe()}, e.g. {self._example()}")
        return number

    def _example(self) -> int:
        return self.min if self.min is not None else 1


@dataclasses.dataclass(frozen=True)
class Float(Spec):
    """A finite real number with open (``gt``/``lt``) bounds, or a closed lower bound (``ge``,
    for settings where 0 means "off"); ints are welcome.

    ``keep_int`` stores an int as an int (for sizes such as ``fuse_grad_size_in_MB`` that Paddle
    types as int but where a fraction is meaningful too); otherwise everything becomes a float.
    """

    gt: float | None = None
    lt: float | None = None
    keep_int: bool = False
    ge: float | None = None

    def describe(self) -> str:
        if self.ge is not None:
            return f"number >= {self.ge:g}"
        if self.gt is not None and self.lt is not None:
            return f"number in ({self.gt:g}, {self.lt:g}), bounds excluded"
        if self.gt is not None:
            return f"number > {self.gt:g}"
        if self.lt is not None:
            return f"number < {self.lt:g}"
        return "finite number"

    def check(self, field: str, value: Any) -> float | int:
        if not _is_real(value):
            hint = " (bool is not accepted as a number here)" if isinstance(value, bool) else ""
            raise type_error(field, value, f"a {self.describe()}{hint}",
                             "pass an int or a float, not a string or a bool")
        number: float | int = int(value) if (self.keep_int and _is_int(value)) else float(value)
        if not math.isfinite(number):
            raise value_error(field, value, f"a finite {self.describe()}", "use a finite number")
        if (self.gt is not None and not number > self.gt) or (
            self.lt is not None and not number < self.lt
        ) or (self.ge is not None and not number >= self.ge):
            raise value_error(field, value, f"a {self.describe()}",
                              f"choose a value {self._range_words()}")
        return number

    def _range_words(self) -> str:
        if self.ge is not None:
            return f"at or above {self.ge:g}"
        if self.gt is not None and self.lt is not None:
            return f"strictly between {self.gt:g} and {self.lt:g}"
        if self.gt is not None:
            return f"strictly above {self.gt:g}"
        return f"strictly below {self.lt:g}"


@dataclasses.dataclass(frozen=True)
class Choice(Spec):
    """One member of a closed ``str`` enum; accepts the member or its string value."""

    enum: type[Enum]

    def values(self) -> list[str]:
        return [str(m.value) for m in self.enum]

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values())

    def check(self, field: str, value: Any) -> Enum:
        if isinstance(value, self.enum):
            return value
        if not isinstance(value, str):
            raise type_error(field, value, f"a str, {self.describe()}",
                             f"pass one of the strings {self.values()}")
        for member in self.enum:
            if member.value == value:
                return member
        near = suggest(value, self.values())
        fix = f"did you mean {near!r}? " if near else ""
        raise value_error(field, value, self.describe(), f"{fix}use one of {self.values()}")

    def to_plain(self, value: Any) -> str:
        return str(value.value)


@dataclasses.dataclass(frozen=True)
class Reduction(Spec):
    """One of the core's reductions (`fleetlike.config.reductions.ReduceOp`) under this option's
    own spellings: ``names`` pairs each accepted string with its member (EPL's ``"mean"`` is
    ``ReduceOp.AVG``). The spelling is stored, so the option reads and saves as it is written;
    the member is accepted too; `op` gives the member a spelling names."""

    names: tuple[tuple[str, ReduceOp], ...]

    def values(self) -> list[str]:
        return [k for k, _ in self.names]

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values())

    def check(self, field: str, value: Any) -> str:
        if isinstance(value, ReduceOp):
            for spelling, member in self.names:
                if member is value:
                    return spelling
            raise value_error(field, value.value, self.describe(), f"use one of {self.values()}")
        if not isinstance(value, str):
            raise type_error(field, value, f"a str, {self.describe()}", f"pass one of the strings {self.values()}")
        if value in self.values():
            return value
        near = suggest(value, self.values())
        fix = f"did you mean {near!r}? " if near else ""
        raise value_error(field, value, self.describe(), f"{fix}use one of {self.values()}")

    def op(self, value: str) -> ReduceOp:
        """The member a stored spelling names."""
        return dict(self.names)[value]


def _check_names(field: str, value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        fix = (f"wrap a single name in a list: [{value!r}]" if isinstance(value, str)
               else "pass a list of strings")
        raise type_error(field, value, f"a list of {what}", fix)
    for item in value:
        if not isinstance(item, str):
            raise type_error(field, value, f"a list of {what} (every item a str)",
                             f"replace {item!r} by its name as a string")
        if not item.strip():
            raise value_error(field, list(value), f"a list of non-empty {what}",
                              "remove the empty name")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class StrList(Spec):
    """A list of names (stored as a tuple so that ``.append`` on a read copy fails loudly)."""

    what: str = "names"

    def describe(self) -> str:
        return f"a list of {self.what}"

    def check(self, field: str, value: Any) -> tuple[str, ...]:
        return _check_names(field, value, self.what)

    def to_plain(self, value: Any) -> list[str]:
        return list(value)


@dataclasses.dataclass(frozen=True)
class Checkpoints(Spec):
    """Recompute checkpoints: submodule names (``model.named_modules()`` keys) or ``"auto"``."""

    def describe(self) -> str:
        return "a list of submodule names, or 'auto'"

    def check(self, field: str, value: Any) -> tuple[str, ...] | str:
        if isinstance(value, str):
            if value == "auto":
                return value
            raise value_error(field, value, self.describe(),
                              f"for one submodule pass a list: [{value!r}]; or pass 'auto'")
        return _check_names(field, value, "submodule names")

    def to_plain(self, value: Any) -> list[str] | str:
        return value if isinstance(value, str) else list(value)


# --------------------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Field:
    """One option: name, spec, Paddle 2.x default and a one-line tuning note.

    ``requires`` names the on/off switch without which the option has no effect (reported by
    ``inactive_settings``); in a section it replaces the section's own, and ``""`` says the
    option acts whatever the section's switch (``sharding_configs.clip_norm`` in data parallel); ``inert`` explains why an option is recorded but cannot have an effect
    in PyTorch at all; ``feature`` marks the top-level switches that ``enabled_features`` lists.
    """

    name: str
    spec: Spec
    default: Any
    note: str
    requires: str | None = None
    inert: str | None = None
    feature: bool = False


@dataclasses.dataclass(frozen=True)
class Section:
    """A ``*_configs`` group: a fixed set of keys that the user sees as a dict.

    ``check`` validates the merged section after an update (for constraints that involve two
    keys); ``from_object`` lets the section be assigned from an object carrying its keys as
    attributes (Paddle's ``ExecutionStrategy``).
    """

    name: str
    fields: tuple[Field, ...]
    note: str
    requires: str | None = None
    inert: str | None = None
    check: Callable[[str, Mapping[str, Any]], None] | None = None
    from_object: bool = False

    def field(self, key: str) -> Field | None:
        for f in self.fields:
            if f.name == key:
                return f
        return None

    def keys(self) -> list[str]:
        return [f.name for f in self.fields]


@dataclasses.dataclass(frozen=True)
class Alias:
    """A Fleet 1.x name for canonical storage.

    A plain alias has a ``target`` (``"localsgd"``, ``"localsgd_configs.k_steps"`` or a whole
    section such as ``"execution_strategy"``). A derived alias (``collective_mode``) has no single
    target: ``spec`` validates the value, ``write`` turns it into canonical updates, ``read``
    computes it from the stored values, and ``touches`` lists the canonical paths it may change.
    """

    name: str
    target: str | None
    note: str
    spec: Spec | None = None
    read: Callable[[Callable[[str], Any]], Any] | None = None
    write: Callable[[Any], dict[str, Any]] | None = None
    touches: tuple[str, ...] = ()
