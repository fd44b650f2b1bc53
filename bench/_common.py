"""Helpers every benchmark shares: sizes, interleaved timing, tables, machine info, JSON, plots.

A benchmark in ``bench/`` compares two (or more) implementations side by side in one run and
reports the ratio; these helpers keep the method identical across scripts:

- `interleaved_timings` alternates the implementations rep by rep (and which goes first), so
  machine noise (the other rank, the OS) hits every implementation alike; report the median.
- `format_table` prints aligned columns; `save_json` and `plot_panels` write the artefacts;
  `run_info` records the machine, the command and the date with them.

Example:
    >>> times = interleaved_timings({"a": f, "b": g}, reps=7, inner=10)
    >>> median(times["a"]) / median(times["b"])
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "parse_or_run_worker",
    "parse_bytes",
    "human_bytes",
    "size_ladder",
    "median",
    "interleaved_timings",
    "Column",
    "format_table",
    "machine_info",
    "command_line",
    "run_info",
    "save_json",
    "plot_panels",
    "run_mpiexec",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """``"256M"`` -> 268435456. Units K, M, G are binary (KiB, MiB, GiB); a trailing B/iB is allowed."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not a byte count like 8, 64K, 1M, 256MiB")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human_bytes(n: int) -> str:
    """8 -> '8 B', 1048576 -> '1 MiB', 1536 -> '1.5 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def size_ladder(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Sizes from ``max_bytes`` down by ``factor`` while above ``min_bytes``, plus ``min_bytes``.

    Anchored at the top so powers of two such as 1 MiB and 16 MiB are hit with factor 4 and a
    256 MiB maximum."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor={factor} must be at least 2")
    sizes = []
    s = max_bytes
    while s > min_bytes:
        sizes.append(s)
        s //= factor
    sizes.append(min_bytes)
    return sorted(set(sizes))


def proc_status(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in bytes (Linux's
    ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


@contextlib.contextmanager
def cpu_lock(path: str | None) -> Iterator[None]:
    """Hold the machine's CPU lock (``flock`` on ``path``) around one timed unit (a round, a
    storage's passes, a memory run), so a shared machine's other jobs run between units and
    never inside a timing; no lock without ``path`` (the caller holds the machine)."""
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def interleaved_timings(
    fns: Mapping[str, Callable[[], Any]],
    *,
    reps: int,
    inner: int = 1,
    sync: Callable[[], Any] | None = None,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each function, ``reps`` samples each, implementations interleaved.

    Each sample times ``inner`` back-to-back calls after ``sync()`` (a barrier, for collectives)
    and divides. Rep ``i`` runs the implementations in rotated order, so none is always first.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out[name].append((time.perf_counter() - t0) / inner)
    return out


class Column:
    """One table column: the row key, its header and a format (str.format spec or a callable)."""

    def __init__(self, key: str, header: str, fmt: str | Callable[[Any], str] = "{}") -> None:
        self.key, self.header, self.fmt = key, header, fmt

    def render(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


def format_table(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]], *, markdown: bool = False) -> str:
    """Right-aligned text table (or a Markdown table) of ``rows`` under ``columns``."""
    cells = [[c.header for c in columns]] + [[c.render(r) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    if markdown:
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |",
                 "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
        lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells[1:]]
        return "\n".join(lines)
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def machine_info() -> dict[str, Any]:
    """CPU count and model, OS, and the versions of the libraries a benchmark depends on."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for mod in ("torch", "numpy", "mpi4py"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional dependency
            pass
    try:
        from mpi4py import MPI

        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - optional dependency
        pass
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line(module: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run: ``python -m <module> <args>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = ["python", "-m", module] if module else ["python", sys.argv[0]]
    return shlex.join(head + args)


def run_info(module: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every result file records: command, UTC date and time, machine."""
    return {
        "command": command_line(module, argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
    }


def save_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON, creating the folder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2) + "\n")
    return p


def plot_panels(
    path: str | Path,
    title: str,
    panels: Sequence[Mapping[str, Any]],
    *,
    xlabel: str = "message size",
    ylabel: str = "busbw (GB/s)",
    ratio_label: str = "ratio",
    ratio_target: float | None = None,
    xfmt: Callable[[float], str] = lambda v: human_bytes(int(v)),
) -> Path:
    """A PNG with one column per panel: the series on top (log x), their ratio below.

    Each panel is ``{"title": str, "x": [...], "series": {label: [...]}, "ratio": [...]}``;
    ``ratio`` is optional, and may be ``{label: [...]}`` for several ratio lines (a control, say).
    Uses the Agg backend: no display needed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    n = len(panels)
    has_ratio = any(p.get("ratio") for p in panels)
    rows = 2 if has_ratio else 1
    fig, axes = plt.subplots(
        rows, n, figsize=(4.2 * n, 6.0 if has_ratio else 3.6), squeeze=False,
        gridspec_kw={"height_ratios": [2, 1]} if has_ratio else None, sharex="col",
    )
    for i, panel in enumerate(panels):
        ax = axes[0][i]
        for label, ys in panel["series"].items():
            ax.plot(panel["x"], ys, marker="o", markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(panel["title"])
        ax.grid(True, which="both", alpha=0.3)
        if i == 0:
            ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        if has_ratio:
            rax = axes[1][i]
            ratios = panel.get("ratio") or {}
            if not isinstance(ratios, Mapping):
                ratios = {None: ratios}
            for j, (label, ys) in enumerate(ratios.items()):
                rax.plot(panel["x"], ys, marker="o", markersize=3, label=label,
                         color="tab:green" if j == 0 else "tab:gray", alpha=1.0 if j == 0 else 0.8)
            if any(label is not None for label in ratios):
                rax.legend(fontsize=7)
            if ratio_target is not None:
                rax.axhline(ratio_target, color="tab:red", linestyle="--", linewidth=1)
            rax.axhline(1.0, color="gray", linewidth=0.8)
            rax.set_xscale("log", base=2)
            rax.grid(True, alpha=0.3)
            if i == 0:
                rax.set_ylabel(ratio_label)
        bottom = axes[rows - 1][i]
        xs = sorted(set(panel["x"]))
        step = max(1, -(-len(xs) // 5))  # at most ~5 labelled ticks, the largest size included
        ticks = xs[::-1][::step][::-1]
        bottom.xaxis.set_major_locator(FixedLocator(ticks))
        bottom.xaxis.set_minor_locator(NullLocator())
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: xfmt(v)))
        bottom.tick_params(axis="x", labelrotation=30)
        bottom.set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def run_mpiexec(n: int, args: Sequence[str], *, timeout: float, cwd: str | Path | None = None) -> str:
    """Run ``mpiexec -n n <args>`` (the mpiexec next to this interpreter, from the ``mpich`` wheel).

    The job runs in its own process group, killed whole when it outlives ``timeout`` seconds or
    the caller is interrupted. Returns the combined output; raises RuntimeError on failure."""
    import signal
    import subprocess

    exe = Path(sys.executable).parent / "mpiexec"
    if not os.access(exe, os.X_OK):
        raise RuntimeError(f"no mpiexec at {exe}; install the MPI extra: pip install mpi4py mpich")
    cmd = [str(exe), "-launcher", "fork", "-bind-to", "none", "-n", str(n), *args]
    env = dict(os.environ)
    env.setdefault("HYDRA_IFACE", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as exc:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RuntimeError(
                f"{shlex.join(cmd)} did not finish within {timeout:g}s; killed. Output:\n"
                + out.decode(errors="replace")[-4000:]
            ) from None
        raise
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{text[-4000:]}")
    return text


def replace_section(path: str | Path, title: str, section: str) -> None:
    """Put ``section`` (starting with the ``title`` line, e.g. "## Recompute") into the Markdown
    file at ``path``: in the old section's place, else appended; other sections stay as and where
    they are (the manual's order is its reader's, not the order benchmarks last ran)."""
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n"
    body = section.strip() + "\n"
    start = text.find("\n" + title + "\n")
    if start < 0:
        p.write_text(text.rstrip() + "\n\n" + body)
        return
    nxt = text.find("\n## ", start + len(title) + 1)
    rest = "\n" + text[nxt + 1:] if nxt >= 0 else ""
    p.write_text(text[:start].rstrip() + "\n\n" + body + rest)


def save_figure(fig: Any, path: Path | str) -> None:
    """Write a benchmark's matplotlib figure to ``path`` (folders made) and free it: the one
    place every bench's plot ends, so they all land the same way (110 dpi)."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_or_run_worker(ap: argparse.ArgumentParser, argv: Sequence[str] | None,
                        worker: Callable[..., Any]) -> argparse.Namespace | None:
    """Parse a multi-process benchmark's flags, or be one of its workers.

    The netns benchmarks start their ranks as ``python -m bench.X --worker R --spec JSON``
    (`bench.netns.TwoNodes.run_module`); such a process runs ``worker(R, **spec)`` and gets None,
    so ``main`` returns at once. The driver gets its parsed flags.
    """
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is None:
        return args
    worker(args.worker, **json.loads(args.spec))
    return None
