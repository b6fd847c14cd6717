"""`swapformer.cli.main`: the `swapformer` command line run in this process (tests, notebooks, scripts).

The subcommand table, the dispatch and the error contract (one line, exit code 2 for a mistake the user can
fix, 1 for a failure of the run, the traceback with `--debug`) live in `swapformer_command.py`, outside
this package, so that `swapformer --help`, `--version` and `swapformer backends` answer without importing
torch. `main` here leaves the process as it is; the console script (`swapformer_command.main`) also drops
libraries' import messages and stops quietly on a closed pipe.
"""

from __future__ import annotations

import sys

from swapformer_command import USER_ERRORS, build_parser, error_line
from swapformer_command import main as command_main
from swapformer_command import run as main

__all__ = ["USER_ERRORS", "build_parser", "error_line", "main"]

if __name__ == "__main__":
    sys.exit(command_main())
