"""Processes: starting and joining a multi-process run.

Owns `initialize` (`initialize`, reading the variables of each cluster in `clusters`),
the launcher behind `python -m eqxshard.launch` (`launcher`, `gloo_chatter`) and
`check_setup` (`setup_check`).

Imports: everything below it and this folder (it waits for unfinished checkpoint saves
at exit, so it sits above `_checkpoint`).
"""
