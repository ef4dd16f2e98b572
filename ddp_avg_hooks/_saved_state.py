"""An :class:`AveragingHandle`'s checkpoint: what ``state_dict()`` saves, and the checks
a saved one must pass against the handle loading it."""

from __future__ import annotations

import dataclasses


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


class HandleCheckpointing:
    """``AveragingHandle``'s checkpoint calls: what it saves, what it checks on loading."""

    def config(self) -> dict:
        """What every rank, and a checkpoint being loaded, must agree on."""
        return {
            "hook": self._engine.name,
            "period": self._schedule.describe(),
            "warmup_steps": self._warmup_steps,
            "overlap": self._options.overlap,
            "fragments": len(self._engine.fragments),
            "layout": [b._layout() for b in self._engine.buckets],
        }

    def state_dict(self) -> dict:
        """This rank's averaging state: counter, anchors, hook state, stats, config.

        Tensors and plain values only, so ``torch.save`` takes it; it differs between
        ranks (error feedback, local progress), so save one per rank.
        """
        self._check_alive("state_dict")
        self.synchronize()
        saved = [b._state_dict() for b in self._engine.buckets]
        out = {
            "step_count": self._step_count,
            "next_round": min(self._plan.next_rounds),
            "plan": self._plan.state_dict(),
            "weight_totals": self._weights.state_dict(),
            "config": self.config(),
            "schedule": self._schedule.state_dict(),
            "anchors": [s["anchor"] for s in saved],
            "bucket_memory": [s["memory"] for s in saved],
            "stats": dataclasses.asdict(self.stats),
        }
        if hasattr(self.state, "state_dict"):
            out["hook_state"] = self.state.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (on this rank, into a fresh handle).

        Raises ``ValueError`` naming the first difference when the checkpoint was made
        with another hook, period, warm-up or bucket layout; nothing is changed then.
        """
        self._check_alive("load_state_dict")
        check_checkpoint(state_dict)
        self.synchronize()
        saved = bucket_entries(state_dict)
        check_matches(state_dict, self.config(), self._engine.buckets, saved, self.state)
        if hasattr(self.state, "load_state_dict"):
            self.state.load_state_dict(state_dict["hook_state"])
        self._schedule.load_state_dict(state_dict["schedule"])
        for bucket, entry in zip(self._engine.buckets, saved):
            bucket._load_state_dict(entry)
        self.stats = type(self.stats)(**state_dict["stats"])
        self._step_count = int(state_dict["step_count"])
        self._rounds_started = self.stats.rounds  # a checkpoint holds no round in flight
        self._plan.load_state_dict(state_dict.get("plan") or plan_before_fragments(state_dict))
        self._weights.load_state_dict(state_dict.get("weight_totals"))
