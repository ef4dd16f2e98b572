"""Round checkpoints that every rank agrees on: save at round boundaries, resume the newest.

:class:`RoundCheckpointer` saves, right after every ``every_rounds``-th round, what each
rank needs to resume exactly, and on start loads the newest round that *every* rank
completed (ranks agree on which through one ``all_gather_object``). Each file is written
to a temporary name, flushed to disk and renamed, and a round counts as completed by a
rank only once its marker file exists, so a crash during a save never leaves a torn
checkpoint that loads. The last ``keep`` rounds that all ranks completed are kept.

Saves survive being killed anywhere (``SIGKILL``, a node lost), then re-done by restarted
processes: a save first removes this rank's marker of that round, so a marker always
belongs to the files beside it; and each marker names the *session* that wrote it (a
token the ranks agree on at :meth:`~RoundCheckpointer.restore` or at the first save), so
a round counts as completed only if every rank's marker names the same session. Ranks'
files from two different attempts at one round (one rank finished it before a crash,
the others only after the restart) are therefore never combined, even when a run is not
bit-reproducible.

What is saved, per rank, and why (folder ``round-NNNNNNNN/``):

* ``rank{r}.pt``: the optimizer and LR scheduler state, ``handle.state_dict()`` (step
  counter, anchors, error feedback, hook state, stats) and the RNG states (Python,
  torch CPU and CUDA). These differ between ranks: local momentum and residuals, each
  rank's data order.
* ``model.pt``, written by rank 0 only, after a blocking round: right after one, every
  rank holds bit-identical parameters, so one copy is enough (on restore rank 0 reads it
  and broadcasts it, so the ranks need no shared file system). After an overlapped round
  (``overlap=True``) replicas differ, and each rank writes ``model_rank{r}.pt``.
* ``rank{r}.done``: the marker, written last (atomically; it holds the session token).

Plain files and ``torch.save`` are used rather than ``torch.distributed.checkpoint``: DCP
saves one copy of a tensor that every rank names the same, which loses the per-rank
state, and its ``get_state_dict``/``set_state_dict`` drop ``AveragingOptimizer``'s
``"averaging"`` entry. (The ``optimizer.step()`` they run at lr 0 to create a fresh
optimizer's state is not counted by a handle registered with ``optimizer=``.)

Example:
    >>> import tempfile, torch, torch.distributed as dist
    >>> import ddp_avg_hooks as dah
    >>> from ddp_avg_hooks.checkpoint import RoundCheckpointer
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
    ...                                      optimizer=opt)
    >>> ckpt = RoundCheckpointer(tempfile.mkdtemp(), handle, ddp.module, opt)
    >>> ckpt.restore()  # nothing saved yet: start from scratch
    >>> for _ in range(4):
    ...     opt.zero_grad(); ddp(torch.randn(3, 4)).sum().backward(); opt.step()
    ...     _ = ckpt.maybe_save()
    >>> ckpt.completed_rounds()
    [1, 2]
    >>> handle.remove(); dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import os
import random
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ._checks import check_int
from .optim import AveragingOptimizer

_PREFIX = "round-"


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RoundCheckpointer:
    """Save every ``every_rounds``-th round of ``handle``; resume the newest all ranks completed.

    Args:
        directory: where the rounds' folders go (shared by the ranks or not: each rank
            reads only its own files).
        handle: the :class:`~ddp_avg_hooks.AveragingHandle`.
        model: the module whose ``state_dict()`` is saved (``ddp.module``).
        optimizer: the local optimizer (or an ``AveragingOptimizer``).
        scheduler: an LR scheduler, or ``None``.
        every_rounds: save after every N-th round (``>= 1``).
        keep: how many completed rounds to keep (``>= 1``).

    Call :meth:`restore` once before training (collective) and :meth:`maybe_save` after
    every optimizer step (collective when it saves; every rank saves the same rounds).
    """

    def __init__(self, directory, handle, model: torch.nn.Module, optimizer, scheduler=None, *,
                 every_rounds: int = 1, keep: int = 2, process_group=None) -> None:
        self.directory = Path(directory)
        self.handle, self.model = handle, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.every_rounds = check_int("every_rounds", every_rounds, 1, owner="RoundCheckpointer")
        self.keep = check_int("keep", keep, 1, owner="RoundCheckpointer")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self._saved_at = handle.rounds_started
        self._session: str | None = None  # agreed by the ranks at restore() or the first save

    def _local_optimizer(self):
        """The optimizer whose state is saved beside the handle's: an
        ``AveragingOptimizer`` of this handle carries the handle's state in its own
        ``state_dict()``, which is saved once, under ``"averaging"``, so its inner one."""
        if isinstance(self.optimizer, AveragingOptimizer) and self.optimizer.handle is self.handle:
            return self.optimizer.optimizer
        return self.optimizer

    # --- saving -----------------------------------------------------------------------
    def maybe_save(self) -> bool:
        """Save if a round ran since the last call and it is an ``every_rounds``-th one.

        With ``overlap=True`` the save finishes the round in flight first, as
        ``handle.state_dict()`` does, at the step that launched it (a step every rank
        shares).
        """
        rounds = self.handle.rounds_started
        if rounds == self._saved_at:
            return False
        self._saved_at = rounds
        if rounds % self.every_rounds:
            return False
        self.save()
        return True

    def save(self) -> Path:
        """Save this rank's state as round ``handle.stats.rounds`` (collective: prunes after)."""
        self.handle.synchronize()
        rounds = self.handle.stats.rounds
        folder = self.directory / f"{_PREFIX}{rounds:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        session = self._agreed_session()
        # a marker left by an earlier attempt at this round must not vouch for the new files
        (folder / f"rank{self.rank}.done").unlink(missing_ok=True)
        own_model = self.handle.options.overlap
        if own_model:
            _atomic_save(self.model.state_dict(), folder / f"model_rank{self.rank}.pt")
        elif self.rank == 0:
            _atomic_save(self.model.state_dict(), folder / "model.pt")
        state = {
            "optimizer": self._local_optimizer().state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "averaging": self.handle.state_dict(),
            "rng": _rng_state(),
            "own_model": own_model,
        }
        _atomic_save(state, folder / f"rank{self.rank}.pt")
        self._mark_completed(folder, session)
        self._prune()
        return folder

    def _mark_completed(self, folder: Path, session: str) -> None:
        """Write this rank's marker: its files in ``folder`` are complete.

        The last step of a save (fault-injection tests override it to stop just before).
        """
        _atomic_write_text(session, folder / f"rank{self.rank}.done")

    def _agreed_session(self) -> str:
        """The token this process's markers carry: rank 0's, the same on every rank."""
        if self._session is None:
            token = [uuid.uuid4().hex]
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                dist.broadcast_object_list(token, src=src, group=self.group)
            self._session = token[0]
        return self._session

    def _prune(self) -> None:
        """Remove this rank's files of rounds older than the newest common one, but the
        ``keep`` newest common; completed or not (an interrupted save leaves files)."""
        common = self._common_rounds()
        keep = set(common[-self.keep:])
        newest_common = common[-1] if common else -1
        for folder in self.directory.glob(f"{_PREFIX}*"):
            try:
                rounds = int(folder.name[len(_PREFIX):])
            except ValueError:
                continue
            if rounds < newest_common and rounds not in keep:
                # in a shared directory another rank may remove the folder meanwhile
                with contextlib.suppress(FileNotFoundError):
                    for f in list(folder.glob(f"*rank{self.rank}.*")):
                        f.unlink(missing_ok=True)
                    if self.rank == 0:
                        for f in list(folder.glob("model.pt*")):
                            f.unlink(missing_ok=True)
                try:  # the last rank to leave removes the folder (shared or not)
                    folder.rmdir()
                except OSError:
                    pass

    @torch.no_grad()
    def _load_model(self, folder: Path, *, own: bool) -> None:
        """In place (DDP and the buckets keep their tensors); rank 0's copy is broadcast."""
        current = self.model.state_dict()
        if own:
            saved = torch.load(folder / f"model_rank{self.rank}.pt", weights_only=False)
        elif self.rank == 0:
            saved = torch.load(folder / "model.pt", weights_only=False)
        else:
            saved = current  # filled by the broadcast below
        for name, tensor in current.items():
            if saved is not current:
                tensor.copy_(saved[name])
            if not own and dist.is_initialized() and dist.get_world_size(self.group) > 1:
                src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                dist.broadcast(tensor, src=src, group=self.group)

    # --- restoring --------------------------------------------------------------------
    def completed_rounds(self) -> list[int]:
        """The rounds this rank completed a save of, oldest first."""
        return sorted(self._markers())

    def _markers(self) -> dict[int, str]:
        """Round -> session token of this rank's marker, for the rounds it completed."""
        if not self.directory.is_dir():
            return {}
        out = {}
        for folder in self.directory.glob(f"{_PREFIX}*"):
            try:
                marker = folder / f"rank{self.rank}.done"
                out[int(folder.name[len(_PREFIX):])] = marker.read_text()
            except (OSError, ValueError):  # no marker (not completed), or not a round folder
                pass
        return out

    def _common_rounds(self, propose_session: bool = False) -> list[int]:
        """Rounds every rank completed in one session (collective unless world size 1).

        ``propose_session``: also agree on this process's session token (rank 0's proposal).
        """
        mine = (self._markers(), uuid.uuid4().hex if propose_session else None)
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            gathered = [mine]
        else:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
        if propose_session:
            self._session = gathered[0][1]
        first = gathered[0][0]
        return sorted(r for r, token in first.items()
                      if all(g[0].get(r) == token for g in gathered[1:]))

    def restore(self) -> int | None:
        """Load the newest round every rank completed (collective); its number, or ``None``."""
        common = self._common_rounds(propose_session=True)
        if not common:
            return None
        folder = self.directory / f"{_PREFIX}{common[-1]:08d}"
        state = torch.load(folder / f"rank{self.rank}.pt", weights_only=False)
        self._load_model(folder, own=state["own_model"])
        self.handle.load_state_dict(state["averaging"])
        self._local_optimizer().load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self._saved_at = self.handle.rounds_started
        return common[-1]
