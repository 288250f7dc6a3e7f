"""`python .../run_main.py script.py ARGS` (or `-m module ARGS`): runs a launched script as
`__main__` and, once `initialize` has joined a run of several processes, ends the process
at once when a `SystemExit` with a non-zero code leaves the script: `sys.exit(n)` and
`raise SystemExit(n)` written out alike.

Python 3.12+ sees that through `sys.monitoring` (`exits._watch_system_exit`); Python
3.11 has no such hook (CPython reads the code in C, with no Python frame left), so there
the launcher starts each process through this file (`children.child_command`). It is run
by its path, not as `-m eqxshard...`, so that nothing (JAX included) is imported before
the script runs: a script may still set JAX's environment variables first.
"""

import os
import runpy
import sys

EXITS = "eqxshard._processes.exits"


def main(argv: list[str]) -> None:
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()  # as `python -m module` has it
        run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        path = argv[0]
        if not os.path.exists(path):  # as `python script.py` says it, not a traceback
            print(
                f"{sys.executable}: can't open file {os.path.abspath(path)!r}: [Errno 2] No "
                "such file or directory",
                file=sys.stderr,
            )
            sys.exit(2)
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python script.py` has it
        run = lambda: runpy.run_path(path, run_name="__main__")
    try:
        run()
    except SystemExit as e:
        exits = sys.modules.get(EXITS)
        if exits is not None and exits.ends_promptly():
            exits.end_on_system_exit(e.code)
        raise


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: run_main.py script.py [args ...] | -m module [args ...]")
    main(sys.argv[1:])
