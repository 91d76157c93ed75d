"""The ``tokenfleet`` command's entry point: a Ctrl-C while the CLI's modules load (a second or so) ends the
command with ``interrupted`` and exit code 130, as it does once a command runs, not with Python's
traceback."""

from __future__ import annotations

import sys

#: The exit code of a command stopped by Ctrl-C (128 + SIGINT), whenever it comes.
EXIT_INTERRUPTED = 130


def run() -> int:
    try:
        from tokenfleet.cli import main

        return main()  # a command's own Ctrl-C is handled there, with what it means for that command
    except KeyboardInterrupt:  # while loading (main loads its command's modules too)
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
