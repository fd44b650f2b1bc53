"""Human-facing views of the option registry: ``describe``, the printed table, the docs table.

Kept apart from `config` so that the strategy object holds behaviour and this module holds
presentation; both read the same registry (`options.ENTRIES`, `aliases.ALIASES`), which is why a
new option shows up in ``print(strategy)`` and in the generated documentation without any edit
here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleetlike.config.fields import Field, Section, UnknownOptionError, suggest
from fleetlike.config.aliases import ALIASES
from fleetlike.config.options import ENTRIES

__all__ = ["describe_option", "flat_defaults", "known_names", "render_markdown", "render_table"]


def _fields() -> list[tuple[str, Field, Section | None]]:
    """Every canonical flat path with its field and (for section keys) its section, in order."""
    out: list[tuple[str, Field, Section | None]] = []
    for entry in ENTRIES:
        if isinstance(entry, Field):
            out.append((entry.name, entry, None))
        else:
            out.extend((f"{entry.name}.{f.name}", f, entry) for f in entry.fields)
    return out


def flat_defaults() -> dict[str, Any]:
    """The JSON-ready Paddle 2.x defaults, keyed by flat dotted path."""
    return {path: f.spec.to_plain(f.default) for path, f, _ in _fields()}


def known_names() -> list[str]:
    """Every name the user may write: top-level options, sections, flat paths and aliases."""
    names = [e.name for e in ENTRIES]
    names += [path for path, _, sec in _fields() if sec is not None]
    names += [a.name for a in ALIASES]
    return names


def describe_option(name: str) -> str:
    """One paragraph for ``name``: type/constraint, default, tuning note, where it applies."""
    for alias in ALIASES:
        if alias.name == name:
            if alias.target is None:
                kind = f" ({alias.spec.describe()})" if alias.spec is not None else ""
                return f"{name}{kind}: {alias.note}."
            return f"{name}: {alias.note}. " + describe_option(alias.target)
    for entry in ENTRIES:
        if entry.name == name:
            if isinstance(entry, Field):
                return _describe_field(name, entry, None)
            keys = ", ".join(entry.keys())
            extra = f" Only with {entry.requires} = True." if entry.requires else ""
            inert = f" No effect in PyTorch: {entry.inert}." if entry.inert else ""
            return (f"{name} (section, a dict with keys {keys}): {entry.note}; assigning a dict "
                    f"changes only the keys given.{extra}{inert}")
    for path, field, section in _fields():
        if path == name:
            return _describe_field(path, field, section)
    near = suggest(name, known_names())
    fix = f"did you mean {near!r}?" if near else "see DistributedStrategy.option_names()"
    raise UnknownOptionError(name, name, "a known option", fix,
                             f"no option named {name!r}. Fix: {fix}")


def _requires(field: Field, section: Section | None) -> str | None:
    """The switch ``field`` needs: its own (``""``: none, even in a section with one), else its
    section's."""
    if field.requires is not None or section is None:
        return field.requires or None
    return section.requires


def _describe_field(path: str, field: Field, section: Section | None) -> str:
    default = field.spec.to_plain(field.default)
    text = f"{path} ({field.spec.describe()}, default {default!r}): {field.note}."
    requires = _requires(field, section)
    if requires:
        text += f" Only with {requires} = True."
    inert = field.inert or (section.inert if section else None)
    if inert:
        text += f" No effect in PyTorch: {inert}."
    return text


def render_table(
    values: Mapping[str, Any],
    enabled: Sequence[str],
    inactive: Sequence[tuple[str, Any, str]],
) -> str:
    """The ``print(strategy)`` text: one row per option, ``*`` where it differs from the default.

    ``values`` is the strategy's ``to_dict(flat=True)``; section keys are indented under their
    switch so a feature and its settings read as one block.
    """
    defaults = flat_defaults()
    rows: list[tuple[str, str, str, str]] = []
    for path, field, section in _fields():
        value, default = values[path], defaults[path]
        changed = value != default
        nested = field.requires if section is None else section.requires
        name = ("    " if nested else "  ") + path
        rows.append((name, "*" if changed else " ", repr(value), repr(default) if changed else ""))
    width = max(len(r[0]) for r in rows) + 2
    vwidth = max(len(r[2]) for r in rows) + 2
    lines = [
        "DistributedStrategy",
        "  enabled: " + (", ".join(enabled) if enabled else "(nothing)"),
        "  * = differs from the default",
        f"{'  option':<{width}}  {'value':<{vwidth}}default",
    ]
    lines += [f"{n:<{width}}{m} {v:<{vwidth}}{d}".rstrip() for n, m, v, d in rows]
    if inactive:
        lines.append("  recorded but without effect:")
        lines += [f"    {name} = {value!r}: {reason}" for name, value, reason in inactive]
    return "\n".join(lines)


def render_markdown() -> str:
    """A Markdown table of every option and alias, for the project documentation."""
    lines = [
        "| option | type / constraint | default | note |",
        "|---|---|---|---|",
    ]
    for path, field, section in _fields():
        requires = _requires(field, section)
        note = field.note + (f" (only with `{requires}`)" if requires else "")
        default = field.spec.to_plain(field.default)
        lines.append(f"| `{path}` | {field.spec.describe()} | `{default!r}` | {note} |")
    lines += ["", "| Fleet 1.x alias | maps to |", "|---|---|"]
    for alias in ALIASES:
        target = f"`{alias.target}`" if alias.target else alias.note
        lines.append(f"| `{alias.name}` | {target} |")
    return "\n".join(lines) + "\n"
