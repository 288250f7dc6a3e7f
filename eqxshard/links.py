"""The links between devices that `auto_plan` times collectives over.

- `Link`: one link's latency and bandwidth (`auto_plan(links=...)` takes these, or names).
- `LINKS`: the named links (`"nvlink4"`, `"infiniband_ndr"`, `"pcie5"`, ...).
"""

from ._plans.auto.links import LINKS as LINKS, Link as Link
