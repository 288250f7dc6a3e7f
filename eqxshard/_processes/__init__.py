"""Processes: starting and joining a multi-process run, and saying what happened when it
loses one.

Owns `initialize` (`initialize`, reading the variables of each cluster in `clusters`;
around the join, `joining`: the launcher's bounds, `addresses` for hosts whose name is
loopback, and the stderr watcher of `watch` / `failures` that adds an `eqxshard:` line
naming a lost peer; `exits`: ending a failed process at once), the launcher behind
`python -m eqxshard.launch` (`launcher`, with its argument checks and command line;
`attempt`, `children`, `hosts` for runs across hosts, `membership` for the hosts each
attempt runs on with `--min-hosts`, `gloo_chatter`, `run_main`) and `check_setup`
(`setup_check`).

Imports: everything below it and this folder (it waits for unfinished checkpoint saves
at exit and hears of finished ones, so it sits above `_checkpoint`). `failures.py` runs
as a script by its path: it imports the standard library only.
"""
