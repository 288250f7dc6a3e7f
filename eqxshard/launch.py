"""`python -m eqxshard.launch (-n N | --hosts H1,H2 | --hostfile F) [options] -- script.py`.

Runs `script.py` as the processes of one JAX run: N processes on this machine (gloo
collectives on 127.0.0.1), or `--processes-per-host K` on each host, started through
`ssh -o BatchMode=yes {host}` (or `--remote TEMPLATE`) with the coordinator on the first
host. Each line of output is prefixed by its process (`[0] `, `[1] `, ...);
`--max-restarts R` starts the run again after a failure, with `--min-hosts K` on the
hosts that can still be started (at least K). The script joins the run with
`eqxshard.initialize()`. See `eqxshard._processes.launcher` and docs/scaling_out.md.
"""

import sys

from ._processes.launcher import launch as launch, main as main

if __name__ == "__main__":
    sys.exit(main())
