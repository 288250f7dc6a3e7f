"""`python -m eqxshard.launch -n N [options] -- script.py [args ...]`.

Runs `script.py` as N processes of one JAX run on this machine, with gloo collectives on
127.0.0.1, each line of output prefixed by its process (`[0] `, `[1] `, ...). The script
joins the run with `eqxshard.initialize()`.
"""

import sys

from ._processes.launcher import launch as launch, main as main

if __name__ == "__main__":
    sys.exit(main())
