"""``python -m fleetlike.launch``: the only place the launcher ends its process."""

import gc

from fleetlike.launch.hostrun import cli
from fleetlike.launch.preload_server import exit_without_teardown

if __name__ == "__main__":
    gc.freeze()  # what is imported stays; the last look for open files skips it
    # the launcher's own state is closed by then (workers, logs, stores); the interpreter's
    # teardown of torch would add most of a second to every job's end
    exit_without_teardown(cli())  # the ordinary launcher, or the -np/-H form
