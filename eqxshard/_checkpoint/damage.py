"""Whether a step on disk is complete: shared by the steps `latest_step` counts and by
`AsyncSave.wait`, which checks the step it committed."""

from __future__ import annotations

import json
import os


def damage(directory: str, step: int) -> str | None:
    """What is missing or unreadable in step `step` of `directory`, or `None` if its
    metadata is complete (array data is only read by `filter_restore`). URLs are not
    checked."""
    if "://" in directory:
        return None
    step_dir = os.path.join(directory, str(step))
    if not os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA")):
        return f"{step_dir}/_CHECKPOINT_METADATA is missing"
    metadata = os.path.join(step_dir, "default", "_METADATA")
    if not os.path.isfile(metadata):
        return f"{metadata} is missing"
    try:
        with open(metadata) as f:
            tree = json.load(f)["tree_metadata"]
        if not isinstance(tree, dict):
            raise TypeError(type(tree).__name__)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{metadata} is unreadable ({type(e).__name__}: {e})"
    return None
