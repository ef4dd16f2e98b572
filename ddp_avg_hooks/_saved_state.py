"""Checking a saved :meth:`AveragingHandle.state_dict` against the handle loading it."""

from __future__ import annotations


def difference(key: str, theirs, mine, *, theirs_at: str = "there", mine_at: str = "here") -> str:
    """One sentence naming where two configs (see :meth:`AveragingHandle.config`) differ."""
    if key == "layout":
        if len(theirs) != len(mine):
            return (f"the bucket layout differs: {len(theirs)} buckets {theirs_at}, "
                    f"{len(mine)} {mine_at}")
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b)
        return f"the bucket layout differs at bucket {i}: {theirs[i]} {theirs_at}, {mine[i]} {mine_at}"
    return f"{key!r} differs: {theirs!r} {theirs_at}, {mine!r} {mine_at}"


_KEYS = ("step_count", "next_round", "config", "schedule", "anchors", "bucket_memory", "stats")


# config keys added after the first release, and what a checkpoint without them meant
_CONFIG_DEFAULTS = {"fragments": 1}


def plan_before_fragments(state_dict: dict) -> dict:
    """The planner state of a checkpoint saved before fragments existed."""
    return {"next_rounds": [state_dict["next_round"]],
            "last_rounds": [state_dict["next_round"]], "rounds": state_dict["stats"]["rounds"]}


def check_checkpoint(state_dict) -> None:
    if not isinstance(state_dict, dict) or not all(k in state_dict for k in _KEYS):
        raise TypeError(
            "load_state_dict: expected the dict returned by AveragingHandle.state_dict(), "
            f"got {type(state_dict).__name__}"
            + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
        )


def bucket_entries(state_dict: dict) -> list[dict]:
    return [{"anchor": a, "memory": m}
            for a, m in zip(state_dict["anchors"], state_dict["bucket_memory"])]


def check_matches(state_dict: dict, config: dict, buckets, saved: list, hook_state) -> None:
    """Raise ``ValueError`` naming the first way ``state_dict`` does not fit this handle."""
    for key, mine in config.items():
        theirs = state_dict["config"].get(key, _CONFIG_DEFAULTS.get(key))
        if theirs != mine:
            raise ValueError(f"load_state_dict: {difference(key, theirs, mine)}; "
                             "register with the same settings to resume")
    for bucket, entry in zip(buckets, saved):
        bucket._check_state(entry)
    has_hook_state = hasattr(hook_state, "load_state_dict")
    if has_hook_state != ("hook_state" in state_dict):
        raise ValueError(
            "load_state_dict: the checkpoint "
            + ("has no hook state but this hook's state needs one"
               if has_hook_state else "has a hook state but this hook's state takes none")
        )
