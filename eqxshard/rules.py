"""Writing sharding rules of your own.

- `Rule`: the base class of every rule (`path_rules`, `fsdp`, `logical`, `like`, `first`,
  `stages`, which stay at the top level as verbs); subclass it and define `match`.
- `NO_MATCH`: what `Rule.match` returns for a leaf it has nothing to say about.
- `dotted_path`: a leaf's key path in the form rules match and eqxshard prints
  (`layers.0.weight`).
"""

from ._plans.rules import NO_MATCH as NO_MATCH, Rule as Rule
from ._tree import dotted_path as dotted_path
