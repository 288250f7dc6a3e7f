"""The rank phase: rows ranked into a `Plan`.

- `phase`: `rank`, the phase.
- `row`: a row of the table from a compile (the alpha-beta model over the axes' links).
- `table`: the ranking, each row's reason, and the error when nothing fits.
- `topology`: which link each mesh axis gets (nodes crossed, the user's links).
"""
