"""``PerBucket``: a hook state's memory for each bucket, keyed by ``bucket.index()``.

Memory is created at a bucket's first use (or at registration, through the hook's
``prepare_bucket``). A checkpoint may be loaded before that: its entries wait and are
applied when the bucket's memory is created, and ``state_dict()`` still holds them.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.bucket import ParamBucket
    >>> from ddp_avg_hooks.hooks._per_bucket import PerBucket
    >>> memory = PerBucket("MyState", create=lambda b: torch.zeros(b.numel()),
    ...                    save=torch.clone, load=lambda mine, saved: mine.copy_(saved),
    ...                    numel=torch.Tensor.numel)
    >>> memory.load_state_dict({0: torch.ones(2)})    # before the bucket's first use
    >>> bucket = ParamBucket(0, [torch.zeros(2)], is_last=True)
    >>> memory.get(bucket).tolist(), sorted(memory.state_dict())
    ([1.0, 1.0], [0])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..trees import clone_tree

T = TypeVar("T")


class PerBucket(Generic[T]):
    """Memory of type ``T`` per bucket index.

    Args:
        owner: the state class's name, for messages.
        create: ``create(bucket) -> T``, the memory of a bucket seen for the first time.
        save: ``save(memory) -> entry``, what a checkpoint keeps (cloned, not aliased).
        load: ``load(memory, entry)``, restore an entry into existing memory.
        numel: ``numel(memory) -> int``, the bucket size the memory was made for.
    """

    def __init__(self, owner: str, *, create: Callable, save: Callable, load: Callable,
                 numel: Callable[[T], int]) -> None:
        self._owner = owner
        self._create, self._save, self._load, self._numel = create, save, load, numel
        self._memory: dict[int, T] = {}
        self._pending: dict[int, object] = {}

    def get(self, bucket) -> T:
        """The memory of ``bucket``: made (and a waiting checkpoint entry applied) on first use."""
        index = bucket.index()
        memory = self._memory.get(index)
        if memory is None:
            memory = self._create(bucket)
            pending = self._pending.pop(index, None)
            if pending is not None:
                self._load_checked(index, memory, pending)
            self._memory[index] = memory
        elif self._numel(memory) != bucket.numel():
            raise ValueError(
                f"{self._owner}: bucket {index} has {bucket.numel()} elements but the state's "
                f"memory was made for {self._numel(memory)}; use one {self._owner} per "
                "registration (and load checkpoints saved with the same model)"
            )
        return memory

    def _load_checked(self, index: int, memory: T, entry) -> None:
        try:
            self._load(memory, entry)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(
                f"{self._owner}.load_state_dict: bucket {index} does not match the checkpoint "
                f"({exc}); register the same model with the same options to resume"
            ) from exc

    def __getitem__(self, index: int) -> T:
        return self._memory[index]

    def __contains__(self, index: int) -> bool:
        return index in self._memory

    def __len__(self) -> int:
        return len(self._memory)

    def items(self):
        return sorted(self._memory.items())

    def state_dict(self) -> dict:
        """``index -> entry`` for every bucket, including entries still waiting."""
        out = {i: clone_tree(e) for i, e in self._pending.items()}
        out.update({i: self._save(m) for i, m in self._memory.items()})
        return dict(sorted(out.items()))

    def load_state_dict(self, entries: dict) -> None:
        """Restore ``index -> entry``; buckets without memory yet keep theirs waiting."""
        for index, entry in entries.items():
            memory = self._memory.get(int(index))
            if memory is None:
                self._pending[int(index)] = clone_tree(entry)
            else:
                self._load_checked(int(index), memory, entry)
