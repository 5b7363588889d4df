"""The ``tierlog`` command.  ``tierlog --help`` and ``tierlog COMMAND --help`` explain each part.

Exit codes: 0 success, 1 a runtime failure (corrupt data, an unreachable
system), 2 a usage or configuration error.  Errors are one line on stderr that
names the file, offset or setting, and what to do.

One module per command group; ``parser`` holds the command line, ``main`` the
entry point, ``output`` the table and JSON printing they share.
"""

from streaming.cli.main import main

__all__ = ["main"]
