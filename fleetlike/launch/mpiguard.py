"""What ``mpiexec`` runs for the ``-np/-H --mpi`` form; the standard library only, run by path.

`fleetlike.launch.hostrun` runs this file as ``python .../mpiguard.py MODE ...`` (by path, not
``-m``), so each of the job's ranks and each remote-shell hop pays no ``import fleetlike``
(which brings torch: ~2 s of CPU per process). Two modes:

* ``shell TEMPLATE [ssh options] HOST WORDS...``: hydra's ``-launcher-exec``. Runs ``TEMPLATE``
  (``{host}`` replaced by HOST) followed by WORDS joined into one command line, the way
  ``ssh HOST WORDS...`` runs them; hydra's own ssh options (``-x``) are skipped.
* ``guard COMMAND...``: one rank. Runs COMMAND and, when it fails, prints `GUARD_LINE` and ends
  itself with SIGKILL. Hydra ends the whole job when a process dies by a signal but waits for
  the others when one merely exits non-zero (a worker that never called ``MPI_Init`` cannot
  ``MPI_Abort``), so this is what makes a failed rank stop the job; `hostrun` reads the rank's
  own exit code back from the line.

Example (what hydra runs for each rank)::

    python fleetlike/launch/mpiguard.py guard python train.py
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["FD_VARS", "GUARD_LINE", "guard", "main", "shell"]

#: What `guard` prints (to stderr) before ending itself; ``{how}`` is "exited with code N" or
#: "was killed by signal NAME", as the ordinary launcher says it.
GUARD_LINE = "fleetlike.launch: rank {rank} {how}; ending the job"


def shell(template: str, words: Sequence[str]) -> None:
    """Replace this process by ``template`` for the host that opens ``words`` + one command line."""
    words = list(words)
    while words and words[0].startswith("-"):
        words.pop(0)
    if not words:
        raise SystemExit("mpiguard shell: no host given")
    host, rest = words[0], words[1:]
    argv = [part.replace("{host}", host) for part in shlex.split(template)]
    os.execvp(argv[0], argv + [" ".join(rest)])


def _with_parent() -> None:
    """In the child: SIGKILL when this guard dies (hydra kills the guard, the rank follows)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


#: environment variables through which an MPI launcher names a descriptor the rank must inherit
FD_VARS = ("PMI_FD", "PMIX_SERVER_FD", "OMPI_MCA_ess_base_fd", "HYDI_CONTROL_FD")


def _inherited_fds() -> tuple[int, ...]:
    """The open descriptors named by `FD_VARS` (hydra's PMI_FD first of all)."""
    fds = []
    for var in FD_VARS:
        try:
            fd = int(os.environ.get(var, ""))
        except ValueError:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    return tuple(fds)


def guard(command: Sequence[str]) -> int:
    """Run ``command``; 0 if it succeeded, else print `GUARD_LINE` and die by SIGKILL."""
    try:
        # hydra hands each rank its PMI connection as an inherited descriptor (PMI_FD, and
        # PMI_PORT's fallback none); Popen closes every descriptor but 0-2 unless told to keep it
        proc = subprocess.Popen(list(command), preexec_fn=_with_parent, pass_fds=_inherited_fds())
    except OSError as exc:
        print(f"fleetlike.launch: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    code = proc.wait()
    if code == 0:
        return 0
    if code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    print(GUARD_LINE.format(rank=os.environ.get("PMI_RANK", "?"), how=how), file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return code  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "shell":
        shell(args[1], args[2:])
    if len(args) >= 2 and args[0] == "guard":
        return guard(args[1:])
    print("usage: mpiguard.py shell TEMPLATE [opts] HOST WORDS... | guard COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
