"""EPL's configuration through the environment: ``EPL_<CATEGORY>_<ATTRIBUTE>`` for every key of
EPL's page (``EPL_AMP_LEVEL=O1`` is ``"amp.level": "O1"``).

EPL lets a job change its default configuration either with ``epl.Config({...})`` or with
environment variables. Its variable for the key ``"category.attribute"`` is ``EPL_`` followed by
the key upper-cased with the dot turned into ``_`` (``EPL_GRADIENT_CHECKPOINT_TYPE``,
``EPL_COMMUNICATION_FP16_SCALE``). The variables change the *defaults*: a key given in
``epl.Config``'s dict wins over its variable (EPL's precedence), and fleetlike's own environment
(``FLEETLIKE_STRATEGY``, then the knobs of `fleetlike.config.knobs`) is applied over both.

A value is the text of what the dict would hold: ``true`` / ``false`` (or ``1`` / ``0``) for a
bool, an integer, a number, ``dynamic`` or a number for ``amp.loss_scale``, the string itself for
the others. It goes through the same alias as the dict key (`fleetlike.config.epl_keys` and the
EPL rows of `fleetlike.config.options`), so the same values are refused with the same reasons;
the error names the variable, its value and the fix. A name beginning ``EPL_`` one slip away
from a known one is refused (a misspelt variable never silently does nothing); any other
``EPL_`` name is warned about once and left alone.

This module reads no environment itself: callers pass the mapping
(`fleetlike.roles.settings.strategy_with_env`, and `EplConfig` with ``os.environ``).

Example:
    >>> s = DistributedStrategy()
    >>> apply_epl_env(s, {"EPL_AMP_LEVEL": "O1", "EPL_AMP_LOSS_SCALE": "128"})
    {'EPL_AMP_LEVEL': 'O1', 'EPL_AMP_LOSS_SCALE': '128'}
    >>> s.amp, s.amp_configs["init_loss_scaling"]
    (True, 128.0)
"""

from __future__ import annotations

import copy as _copy
import difflib
import os
import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from fleetlike.config.epl_keys import LossScale, Refused
from fleetlike.config.fields import Bool, Field, Float, Int, Section, Spec, StrategyError
from fleetlike.config.knobs import TYPO_RATIO
from fleetlike.config.aliases import ALIASES
from fleetlike.config.options import ENTRIES
from fleetlike.config.strategy import DistributedStrategy

__all__ = ["EPL_ENV_KEYS", "EPL_PREFIX", "EplConfig", "EplEnvError", "apply_epl_env", "epl_env_options",
           "epl_variable"]

EPL_PREFIX = "EPL_"


class EplEnvError(ValueError):
    """An ``EPL_*`` variable that is misspelt or holds a value its key does not accept."""


def epl_variable(key: str) -> str:
    """The variable of EPL's key: ``"amp.loss_scale"`` -> ``"EPL_AMP_LOSS_SCALE"``."""
    return EPL_PREFIX + key.replace(".", "_").upper()


def _spec_of(key: str) -> Spec:
    """The spec that checks ``key``'s value: a derived alias's own, else its target field's."""
    alias = _EPL_ALIASES[key]
    if alias.spec is not None:
        return alias.spec
    assert alias.target is not None  # registry invariant: an alias has a target or a spec
    head, _, tail = alias.target.partition(".")
    entry = _ENTRIES[head]
    field = entry.field(tail) if isinstance(entry, Section) else entry
    assert isinstance(field, Field)
    return field.spec


#: EPL's dotted keys (the registry's aliases whose name is ``category.attribute``)
_EPL_ALIASES = {a.name: a for a in ALIASES if "." in a.name}
_ENTRIES = {e.name: e for e in ENTRIES}
#: variable -> EPL key, for every key of EPL's page
EPL_ENV_KEYS: dict[str, str] = {epl_variable(k): k for k in _EPL_ALIASES}
_WARNED: set[str] = set()
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _from_text(spec: Spec, text: str) -> Any:
    """The value ``text`` stands for under ``spec`` (ValueError when it is not one)."""
    word = text.strip()
    if isinstance(spec, Refused):
        return _from_text(spec.base, text)
    if isinstance(spec, Bool):
        if word.lower() in _TRUE:
            return True
        if word.lower() in _FALSE:
            return False
        raise ValueError(text)
    if isinstance(spec, Int):
        return int(word)
    if isinstance(spec, Float):
        return float(word)
    if isinstance(spec, LossScale):
        return "dynamic" if word == "dynamic" else float(word)
    return word


def _example(spec: Spec) -> str:
    if isinstance(spec, Refused):
        return repr(spec.accepted).lower() if isinstance(spec.accepted, bool) else str(spec.accepted)
    if isinstance(spec, Bool):
        return "true"
    if isinstance(spec, LossScale):
        return "dynamic"
    return "1" if isinstance(spec, (Int, Float)) else "<value>"


def epl_env_options(environ: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """EPL's keys the ``EPL_*`` variables of ``environ`` set: ``{key: (variable, value)}``, in
    name order, each value converted from its text (not yet checked against the key's range);
    `EplEnvError` for a value that is not of its key's type or a misspelt ``EPL_*`` name."""
    found: dict[str, tuple[str, Any]] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(EPL_PREFIX):
            continue
        key = EPL_ENV_KEYS.get(name)
        if key is None:
            near = difflib.get_close_matches(name, list(EPL_ENV_KEYS), n=1, cutoff=TYPO_RATIO)
            if near:
                raise EplEnvError(f"{name}={text!r} is not an EPL setting; did you mean {near[0]} (EPL's "
                                  f"{EPL_ENV_KEYS[near[0]]})? Fix the name or unset it")
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"{name} is not a variable of EPL's configuration; it is ignored (EPL's are "
                              f"{', '.join(EPL_ENV_KEYS)})", UserWarning, stacklevel=2)
            continue
        spec = _spec_of(key)
        try:
            found[key] = (name, _from_text(spec, text))
        except ValueError:
            raise EplEnvError(f"{name}={text!r} is not accepted: EPL's {key} takes {spec.describe()}"
                              f"{' (write true or false)' if isinstance(spec, Bool) else ''}; set e.g. "
                              f"{name}={_example(spec)}, or unset it") from None
    return found


def apply_epl_env(strategy: DistributedStrategy, environ: Mapping[str, str],
                  keep: Collection[str] = ()) -> dict[str, str]:
    """Apply the ``EPL_*`` variables of ``environ`` to ``strategy`` through EPL's keys, except the
    keys in ``keep`` (those an `epl.Config` dict gave: EPL's dict wins); return the variables
    applied. `EplEnvError` names a variable whose value its key refuses, with the key's reason."""
    applied: dict[str, str] = {}
    for key, (name, value) in epl_env_options(environ).items():
        if key in keep:
            continue
        try:
            strategy.update({key: value})
        except StrategyError as err:
            raise EplEnvError(f"{name}={environ[name]!r} (EPL's {key}) is refused: {err}") from None
        applied[name] = environ[name]
    return applied


def _rebuild(cls: type[EplConfig], values: dict[str, Any], explicit: Iterable[str] = ()) -> EplConfig:
    clone = object.__new__(cls)
    object.__setattr__(clone, "_values", values)
    object.__setattr__(clone, "_explicit", set(explicit))
    return clone


class EplConfig(DistributedStrategy):
    """EPL's ``Config(param_dict=None)``: the defaults changed by the ``EPL_*`` variables of the
    environment (read here, at construction, as EPL does), then ``param_dict`` (EPL's dotted keys
    or any key `DistributedStrategy.update` takes) over them. Its copies keep the type, so the
    variables are never applied a second time over the dict's keys.

    Example:
        >>> os.environ.get("EPL_AMP_LEVEL") is None and EplConfig({"amp.level": "O1"}).amp
        True
    """

    __slots__ = ()

    def __init__(self, param_dict: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        given = set(param_dict or ())
        apply_epl_env(self, os.environ, keep=given)
        if param_dict is not None:
            self.update(param_dict)

    def copy(self) -> EplConfig:
        return _rebuild(type(self), _copy.deepcopy(self._values), self._explicit)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # type: ignore[override]
        return (_rebuild, (type(self), _copy.deepcopy(self._values), self.explicit_options()))
