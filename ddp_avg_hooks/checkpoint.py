"""Round checkpoints that every rank agrees on: save at round boundaries, resume the newest.

:class:`RoundCheckpointer` saves, right after every ``every_rounds``-th round, what each
rank needs to resume exactly, and on start loads the newest round that *every* rank
completed and can verify.

What it guarantees:

* **No torn checkpoint is used.** Each file is written to a temporary name, flushed to
  disk and renamed; a round counts as completed by a rank only once its marker exists,
  and the marker is written last. Each marker names the *session* that wrote it (a token
  the ranks agree on), so a round counts only if every rank's marker names the same
  session: files of two attempts at one round are never combined.
* **Nothing damaged or foreign is loaded.** A marker records the SHA-256 of each file
  beside it; before anything is loaded every rank verifies its files, and the ranks
  agree on the newest round all of them verified. A damaged round is skipped with a
  warning naming the file, and the next older one is used; so is a round whose folder
  holds a rank file of another round (with its marker: the checksums agree, but the
  ranks would resume different rounds). Files are read with
  ``torch.load(weights_only=True)``: tensors and plain containers only, so a file
  replaced by a pickle that runs code is refused, not run. What it writes is plain
  tensors and containers (a sharded model's DTensors are saved as local shards).
* **Nothing is lost.** A checkpoint saved by another number of processes is refused,
  naming both sizes (a rank's files hold its own error feedback and local progress:
  they cannot be merged or split exactly). One of another model is refused naming the
  checkpoint and the first parameter that differs, before anything is loaded; so is one
  whose optimizer has other parameter groups, or that has a scheduler's state where
  this run has no scheduler (or none where it has one). A folder
  that holds completed rounds but cannot be resumed makes
  :meth:`RoundCheckpointer.restore` raise :class:`~ddp_avg_hooks.errors.CheckpointError`
  rather than start over and overwrite it; saving into such a folder without
  :meth:`RoundCheckpointer.restore` is refused the same way. A save prunes old rounds
  only once its own files are on disk and verified, and keeps the ``keep`` newest rounds
  every rank completed. A save that fails on any rank's disk raises
  :class:`~ddp_avg_hooks.errors.CheckpointError` on every rank, pruning nothing.
* **One writer per folder.** A run that restores from a folder, or first saves into it,
  becomes its writer (``rank{r}.writer`` beside the rounds' folders holds its session).
  A run started earlier on the same folder (two jobs by mistake, or a job still alive
  when its replacement resumed) finds this at its next save and raises
  :class:`~ddp_avg_hooks.errors.CheckpointError` on every rank, writing nothing, instead
  of the two replacing and pruning each other's rounds. The newer run saves on.

What is saved, per rank, and why (folder ``round-NNNNNNNN/``):

* ``rank{r}.pt``: the optimizer and LR scheduler state, ``handle.state_dict()`` (step
  counter, anchors, error feedback, hook state, stats) and the RNG states (Python,
  torch CPU and CUDA). These differ between ranks: local momentum and residuals, each
  rank's data order.
* ``model.pt``, written by rank 0 only, after a blocking round: right after one, every
  rank holds bit-identical parameters, so one copy is enough (on restore rank 0 reads it
  and broadcasts it, so the ranks need no shared file system). After an overlapped round
  (``overlap=True``) replicas differ, and with an FSDP2 model every rank holds its own
  shards: then each rank writes ``model_rank{r}.pt``.
* ``rank{r}.done``: the marker, written last (atomically): session, world size and the
  checksums of the rank's files.

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
import hashlib
import json
import os
import pickle
import random
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook, _JoinConfig

from ._checks import check_int
from .errors import CheckpointError
from .models import DTensor, local_tensor
from .optim import AveragingOptimizer
from .trees import map_tensors

__all__ = ["RoundCheckpointer"]

_PREFIX = "round-"
_FORMAT = 1
_STATE_KEYS = {"optimizer", "scheduler", "averaging", "rng", "own_model"}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _aside(path: Path) -> Path:
    """A temporary name next to ``path``, unique to this write: two writers of one name
    (two jobs in one folder by mistake) never take each other's file."""
    return path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def _write_aside(obj, tmp: Path) -> str:
    """Write ``obj`` to ``tmp`` (from :func:`_aside`), synced; its SHA-256, for
    ``os.replace(tmp, path)``."""
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(tmp)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = _aside(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


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


def _plain(tree):
    """``tree`` with every DTensor replaced by its local shard: what ``weights_only`` loads."""
    return map_tensors(local_tensor, tree)


def _load_optimizer(optimizer, saved: dict) -> None:
    """``optimizer.load_state_dict(saved)``, with the local shards of a sharded parameter's
    state turned back into DTensors placed like the parameter."""
    if DTensor is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        for pid, p in zip(ids, params):
            if not isinstance(p, DTensor) or pid not in saved["state"]:
                continue
            local_shape = local_tensor(p).shape
            saved["state"][pid] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride(), run_check=False)
                if isinstance(v, torch.Tensor) and v.dim() and v.shape == local_shape else v
                for k, v in saved["state"][pid].items()}
    optimizer.load_state_dict(saved)


def _read_marker(path: Path) -> dict | str | None:
    """A marker's contents; ``None`` when there is none; what is wrong with it (naming
    the file) when it cannot be read or is not a marker (damaged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path} cannot be read ({exc})"
    try:
        marker = json.loads(text)
    except ValueError:
        marker = None
    if isinstance(marker, dict) and isinstance(marker.get("session"), str):
        return marker
    return f"{path} is damaged (not a completion marker this library writes)"


def _check_parts(handle, model, optimizer) -> None:
    """Refuse, before anything is saved, parts that would make a checkpoint that cannot
    resume this run: arguments out of order, another model or another model's optimizer."""
    if not all(callable(getattr(handle, m, None)) for m in ("state_dict", "averages")):
        raise TypeError(
            "RoundCheckpointer: handle must be the AveragingHandle returned by "
            f"register_averaging_hook, got {type(handle).__name__}; the arguments are "
            "(directory, handle, model, optimizer)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError("RoundCheckpointer: model must be a torch.nn.Module (ddp.module, or "
                        f"the FSDP2 root), got {type(model).__name__}")
    if not any(handle.averages(p) for p in model.parameters()):
        raise ValueError(
            f"RoundCheckpointer: the model ({type(model).__name__}) holds none of the "
            "parameters the handle averages, so its checkpoints would not hold the averaged "
            "model; pass the model registered with register_averaging_hook (ddp.module, or "
            "the FSDP2 root)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("RoundCheckpointer: optimizer must be a torch.optim.Optimizer (or an "
                        f"AveragingOptimizer), got {type(optimizer).__name__}")
    handle.check_optimizer(optimizer, "RoundCheckpointer")


class RoundCheckpointer(Joinable):
    """Save every ``every_rounds``-th round of ``handle``; resume the newest all ranks completed.

    Args:
        directory: where the rounds' folders go (shared by the ranks or not: each rank
            reads only its own files). It belongs to one run: see the module.
        handle: the :class:`~ddp_avg_hooks.AveragingHandle`.
        model: the module whose ``state_dict()`` is saved (``ddp.module``, or the FSDP2 root).
        optimizer: the local optimizer (or an ``AveragingOptimizer``).
        scheduler: an LR scheduler, or ``None``.
        every_rounds: save after every N-th round (``>= 1``).
        keep: how many completed rounds to keep (``>= 1``; the default 2 leaves an older
            round to fall back to if the newest is damaged).
        process_group: the ranks that save together (default: all).

    Call :meth:`restore` once before training (collective) and :meth:`maybe_save` after
    every optimizer step (collective when it saves; every rank saves the same rounds).
    With uneven inputs pass it to ``Join`` after the handle,
    ``Join([ddp, handle, checkpointer])``: a rank whose inputs ran out then saves the
    rounds it takes part in, with the others.
    """

    def __init__(self, directory, handle, model: torch.nn.Module, optimizer, scheduler=None, *,
                 every_rounds: int = 1, keep: int = 2, process_group=None) -> None:
        _check_parts(handle, model, optimizer)
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"RoundCheckpointer: directory must be a path (str or "
                            f"os.PathLike), got {type(directory).__name__}")
        if scheduler is not None and not all(
                callable(getattr(scheduler, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"RoundCheckpointer: scheduler must be an LR scheduler (with state_dict and "
                f"load_state_dict) or None, got {type(scheduler).__name__}")
        super().__init__()  # Joinable: not inside a Join until one is made
        self.directory = Path(directory)
        self.handle, self.model = handle, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.every_rounds = check_int("every_rounds", every_rounds, 1, owner="RoundCheckpointer")
        self.keep = check_int("keep", keep, 1, owner="RoundCheckpointer")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self._saved_at = handle.rounds_started
        self._session: str | None = None  # agreed by the ranks at restore() or the first save
        self._checked_folder = False  # restore() ran, or the first save checked the folder
        self._claimed = False  # this run's session is the folder's writer (see _claim)

    # --- collectives --------------------------------------------------------------------
    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _gather(self, obj) -> list:
        if self._world() == 1:
            return [obj]
        gathered: list = [None] * self._world()
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def _all_ok(self, problem: str | None, what: str) -> None:
        """Raise :class:`CheckpointError` on every rank if any rank has a ``problem``."""
        problems = [(r, p) for r, p in enumerate(self._gather(problem)) if p]
        if problems:
            raise CheckpointError(f"RoundCheckpointer({str(self.directory)!r}): {what}: "
                                  + "; ".join(f"rank {r}: {p}" for r, p in problems))

    # --- uneven inputs: torch.distributed.algorithms.join.Join -------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """Inside ``Join([ddp, handle, checkpointer])``: a rank whose inputs ran out calls
        :meth:`maybe_save` after each step the handle takes in place of the others'."""
        return _SaveWhenJoined(self, self.handle.add_joined_step_hook(self.maybe_save))

    @property
    def join_device(self) -> torch.device:
        """The handle's ``Join`` device."""
        return self.handle.join_device

    @property
    def join_process_group(self):
        """The handle's ``Join`` group."""
        return self.handle.join_process_group

    # --- saving -----------------------------------------------------------------------
    def _local_optimizer(self):
        """The optimizer whose state is saved beside the handle's: an
        ``AveragingOptimizer`` of this handle carries the handle's state in its own
        ``state_dict()``, which is saved once, under ``"averaging"``, so its inner one."""
        if isinstance(self.optimizer, AveragingOptimizer) and self.optimizer.handle is self.handle:
            return self.optimizer.optimizer
        return self.optimizer

    def _own_model(self) -> bool:
        """Whether every rank saves its own model: replicas differ (overlapped rounds) or
        hold different shards (FSDP2)."""
        return self.handle.options.overlap or self.handle.sharded

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
        """Save this rank's state as round ``handle.stats.rounds`` (collective: prunes after).

        A failure on any rank's disk raises :class:`CheckpointError` on every rank,
        naming the rank and its error, with no round pruned; the ranks stay in step, so
        training can go on and a later save can succeed.
        """
        if self.handle.in_join != self._join_config.enable:
            raise RuntimeError(
                f"RoundCheckpointer({str(self.directory)!r}).save() inside Join: pass both the "
                "handle and the checkpointer to it, Join([ddp, handle, checkpointer]), so that "
                "a rank whose inputs ran out saves with the others")
        if not self._checked_folder:
            self._refuse_a_folder_of_another_run()
        self.handle.synchronize()
        rounds = self.handle.stats.rounds
        folder = self.directory / f"{_PREFIX}{rounds:08d}"
        # everything this rank saves, before any file changes: a save that fails (a
        # removed handle, say) leaves every round on disk as it was
        own_model = self._own_model()
        contents = {}
        if own_model or self.rank == 0:
            name = f"model_rank{self.rank}.pt" if own_model else "model.pt"
            contents[name] = _plain(self.model.state_dict())
        contents[f"rank{self.rank}.pt"] = {
            "format": _FORMAT,
            "optimizer": _plain(self._local_optimizer().state_dict()),
            "optimizer_class": _class_name(self._local_optimizer()),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "averaging": self.handle.state_dict(),
            "rng": _rng_state(),
            "own_model": own_model,
        }
        session = self._agreed_session()
        # A rank's disk can fail where the others' do not (full, read-only, a directory
        # where a file goes): each phase's failure is shared before the next collective,
        # so every rank raises instead of waiting for the failed one.
        aside = {name: _aside(folder / name) for name in contents}
        written, problem = {}, None
        try:
            self._check_writer()
            folder.mkdir(parents=True, exist_ok=True)
            for name, obj in contents.items():
                written[name] = (aside[name], _write_aside(obj, aside[name]))
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        try:
            self._all_ok(problem, f"saving round {rounds} failed, so no rank's files of "
                         "it were replaced and the rounds saved before are kept")
        except CheckpointError:
            self._discard(folder, aside.values())
            raise
        # Saving a round again replaces its files: the marker of the earlier save must
        # not vouch for them, so it goes first, and the written files replace the old
        # ones only then (renames; a kill between loses this round's marker only).
        try:
            (folder / f"rank{self.rank}.done").unlink(missing_ok=True)
            for name, (tmp, _) in written.items():
                os.replace(tmp, folder / name)
            self._files = {name: digest for name, (_, digest) in written.items()}
            self._mark_completed(folder, session)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self._prune(problem, rounds)
        return folder

    @staticmethod
    def _discard(folder: Path, aside) -> None:
        """Remove what a failed save wrote beside its files (``aside``), and ``folder``
        if that leaves it empty."""
        for tmp in aside:
            with contextlib.suppress(OSError):  # never written, or not a file
                tmp.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()

    # --- one writer per folder ------------------------------------------------------------
    def _writer_file(self) -> Path:
        return self.directory / f"rank{self.rank}.writer"

    def _claim(self) -> None:
        """Record this run's session as the folder's writer (this rank's file): a run
        saving into the folder since before finds it at its next save and stops."""
        self.directory.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(self._session + "\n", self._writer_file())
        self._claimed = True

    def _try_to_claim(self) -> None:
        """:meth:`_claim` after a restore; a folder this rank cannot write (read-only) is
        claimed by the first save, or that save fails as any would."""
        with contextlib.suppress(OSError):
            self._claim()

    def _check_writer(self) -> None:
        """Claim the folder at this run's first save; at the others raise
        :class:`CheckpointError` if another run has claimed it since (two jobs saving into
        one folder: each would prune and replace the other's rounds)."""
        if not self._claimed:
            return self._claim()
        try:
            writer = self._writer_file().read_text().strip()
        except FileNotFoundError:
            return self._claim()  # removed by hand: nobody else claims it
        if writer != self._session:
            raise CheckpointError(
                f"another run (session {writer[:8]}) restored or saved in "
                f"{str(self.directory)!r} after this one (session {self._session[:8]}) "
                "began, and saves there now; this run saves no more rounds into it. Give "
                "each job its own folder, or stop the other job")

    def _mark_completed(self, folder: Path, session: str) -> None:
        """Write this rank's marker: its files in ``folder`` are complete (and their checksums).

        The last step of a save (fault-injection tests override it to stop just before).
        """
        marker = {"format": _FORMAT, "session": session, "world_size": self._world(),
                  "rank": self.rank, "files": self._files}
        _atomic_write_text(json.dumps(marker, sort_keys=True), folder / f"rank{self.rank}.done")

    def _agreed_session(self) -> str:
        """The token this process's markers carry: rank 0's, the same on every rank."""
        if self._session is None:
            self._session = self._gather(uuid.uuid4().hex)[0]
        return self._session

    def _refuse_a_folder_of_another_run(self) -> None:
        """Before the first save without :meth:`restore`: a folder holding rounds that
        every rank completed (or may have: a damaged marker) belongs to another run;
        saving into it could prune them."""
        self._checked_folder = True
        gathered = self._gather_markers(self._markers())
        held = sorted({*self._common_rounds(gathered), *self._damaged_rounds(gathered)})
        if held:
            raise CheckpointError(
                f"RoundCheckpointer({str(self.directory)!r}): the folder holds round "
                f"{held[-1]} of another run; call restore() first to resume it, or save "
                "into an empty folder (nothing was written)")

    def _prune(self, problem: str | None, rounds: int) -> None:
        """Remove this rank's files of rounds older than the newest common one, but the
        ``keep`` newest common; completed or not (an interrupted save leaves files).

        ``problem``: what failed as this rank marked round ``rounds`` complete; if any
        rank's did, every rank raises :class:`CheckpointError` and removes nothing."""
        gathered = self._gather((problem, self._marker_summary(self._markers())))
        problems = [(r, p) for r, (p, _) in enumerate(gathered) if p]
        if problems:
            raise CheckpointError(
                f"RoundCheckpointer({str(self.directory)!r}): marking round {rounds} "
                "complete failed, so it is not resumed and the rounds saved before are "
                "kept: " + "; ".join(f"rank {r}: {p}" for r, p in problems))
        common = self._common_rounds([markers for _, markers in gathered])
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

    # --- restoring --------------------------------------------------------------------
    def completed_rounds(self) -> list[int]:
        """The rounds this rank completed a save of, oldest first."""
        return sorted(r for r, m in self._markers().items() if isinstance(m, dict))

    def _markers(self) -> dict[int, dict | str]:
        """Round -> this rank's marker, for the rounds it completed; or what is wrong
        with the marker, for a round whose marker is damaged."""
        if not self.directory.is_dir():
            return {}
        out = {}
        for folder in self.directory.glob(f"{_PREFIX}*"):
            try:
                rounds = int(folder.name[len(_PREFIX):])
            except ValueError:  # not a round folder
                continue
            marker = _read_marker(folder / f"rank{self.rank}.done")
            if marker is not None:
                out[rounds] = marker
        return out

    def _gather_markers(self, markers: dict[int, dict | str]) -> list[dict[int, tuple | str]]:
        """Per rank, :meth:`_marker_summary` of its :meth:`_markers` (collective unless
        world size 1)."""
        return self._gather(self._marker_summary(markers))

    @staticmethod
    def _marker_summary(markers: dict[int, dict | str]) -> dict[int, tuple | str]:
        """Round -> ``(session, world size)`` of its marker, or what is wrong with a
        damaged one."""
        return {r: (m["session"], m.get("world_size")) if isinstance(m, dict) else m
                for r, m in markers.items()}

    @staticmethod
    def _common_rounds(gathered: list[dict]) -> list[int]:
        """Rounds every rank completed in one session, from :meth:`_gather_markers`."""
        first = gathered[0]
        return sorted(r for r, m in first.items()
                      if isinstance(m, tuple) and all(g.get(r) == m for g in gathered))

    @staticmethod
    def _damaged_rounds(gathered: list[dict]) -> list[int]:
        """Rounds that every rank has a marker of, one or more of them damaged, the
        others of one session: rounds that may have been completed, and cannot be told."""
        rounds = set.intersection(*(set(g) for g in gathered))
        out = []
        for r in rounds:
            markers = [g[r] for g in gathered]
            sessions = {m[0] for m in markers if isinstance(m, tuple)}
            if any(isinstance(m, str) for m in markers) and len(sessions) <= 1:
                out.append(r)
        return sorted(out)

    def _verify(self, rounds: int, marker: dict) -> str | None:
        """``None`` when every file this rank's marker of ``rounds`` lists is intact,
        else what is wrong (naming the file)."""
        folder = self.directory / f"{_PREFIX}{rounds:08d}"
        files = marker.get("files")
        if not isinstance(files, dict) or f"rank{self.rank}.pt" not in files:
            return f"{folder / f'rank{self.rank}.done'} records no checksums"
        for name, digest in sorted(files.items()):
            path = folder / name
            try:
                if _sha256(path) != digest:
                    return f"{path} is damaged (its checksum differs from the marker's)"
            except OSError as exc:
                return f"{path} cannot be read ({exc})"
        return None

    def restore(self) -> int | None:
        """Load the newest round every rank completed and verified (collective).

        Returns its number, or ``None`` when no round was completed by every rank (a
        fresh start), and makes this run the folder's writer (see the module). Raises
        :class:`~ddp_avg_hooks.errors.CheckpointError` on every rank, loading and writing
        nothing, when the folder cannot be resumed.
        """
        self._checked_folder = True
        markers = self._markers()
        gathered = self._gather_markers(markers)
        world = self._world()
        sizes = sorted({m[1] for g in gathered for m in g.values()
                        if isinstance(m, tuple) and m[1] not in (None, world)})
        if sizes:
            raise CheckpointError(
                f"RoundCheckpointer({str(self.directory)!r}): the checkpoint was saved by "
                f"{sizes[0]} processes and this run has {world}; every rank's files hold its "
                "own state (error feedback, local progress), which cannot be split or merged "
                f"exactly: resume with {sizes[0]} processes, or start in another folder "
                "(nothing was loaded)")
        common = self._common_rounds(gathered)
        unreadable = self._damaged_rounds(gathered)
        self._session = self._gather(uuid.uuid4().hex)[0]
        damaged = []
        for rounds in sorted({*common, *unreadable}, reverse=True):
            if rounds in unreadable:  # the same on every rank: no collective needed
                problems = [f"rank {r}: {g[rounds]}" for r, g in enumerate(gathered)
                            if isinstance(g[rounds], str)]
                damaged += problems
                warnings.warn(f"RoundCheckpointer: round {rounds} cannot be used, trying an "
                              f"older one: {'; '.join(problems)}", stacklevel=2)
                continue
            problem = self._verify(rounds, markers[rounds])
            read = None if problem else self._read(rounds)
            if isinstance(read, str):
                problem, read = read, None
            problems = [f"rank {r}: {p}" for r, p in enumerate(self._gather(problem)) if p]
            if not problems:
                self._load(rounds, *read)
                self._try_to_claim()
                if damaged:
                    warnings.warn(f"RoundCheckpointer: resumed round {rounds} instead of a newer "
                                  f"one: {'; '.join(damaged)}", stacklevel=2)
                self._saved_at = self.handle.rounds_started
                return rounds
            damaged += problems
            warnings.warn(f"RoundCheckpointer: round {rounds} cannot be used, trying an older "
                          f"one: {'; '.join(problems)}", stacklevel=2)
        if common or unreadable:
            raise CheckpointError(
                f"RoundCheckpointer({str(self.directory)!r}): no round every rank completed "
                f"can be verified and read ({'; '.join(damaged)}); refusing to start over in a "
                "folder that holds them: repair the files or start in another folder (nothing "
                "was loaded)")
        self._try_to_claim()
        return None

    def _read(self, rounds: int):
        """``(state, saved model or None)`` of round ``rounds`` on this rank, read with
        ``weights_only=True``; or what kept it from being read, naming the file."""
        folder = self.directory / f"{_PREFIX}{rounds:08d}"
        path = folder / f"rank{self.rank}.pt"
        try:
            state = torch.load(path, weights_only=True)
            if (not isinstance(state, dict) or state.get("format") != _FORMAT
                    or not _STATE_KEYS <= set(state)):
                return f"{path} is not a round checkpoint of this format"
            saved = state["averaging"]
            stats = saved.get("stats") if isinstance(saved, dict) else None
            saved_rounds = stats.get("rounds") if isinstance(stats, dict) else None
            if isinstance(saved_rounds, int) and saved_rounds != rounds:
                # its marker may vouch for it (copied along): the ranks would resume
                # different rounds
                return (f"{path} holds round {saved_rounds}, not round {rounds} (a file of "
                        "another round put in its folder)")
            model = None
            if state["own_model"] or self.rank == 0:
                path = folder / (f"model_rank{self.rank}.pt" if state["own_model"] else "model.pt")
                model = torch.load(path, weights_only=True)
            return state, model, path
        except pickle.UnpicklingError:
            return (f"{path} holds something other than tensors and plain containers, which "
                    "weights_only=True refuses to load (not written by this library, or "
                    "tampered with); it was not run")
        except Exception as exc:  # every rank must hear of it, or the others would wait
            return f"{path} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})"

    def _load(self, rounds: int, state: dict, saved_model: dict | None, model_path) -> None:
        """Check round ``rounds`` fits this run (collective), then load it."""
        problem = None
        if saved_model is not None:
            problem = self._model_difference(saved_model, model_path)
        path = self.directory / f"{_PREFIX}{rounds:08d}" / f"rank{self.rank}.pt"
        if problem is None:
            try:
                self.handle.check_state_dict(state["averaging"])
            except (TypeError, ValueError) as exc:
                problem = f"{path}: {exc}"
        if problem is None:
            problem = self._optimizer_difference(state, path)
        self._all_ok(problem, f"round {rounds} does not fit this run")
        self._load_model(saved_model, own=state["own_model"])
        self.handle.load_state_dict(state["averaging"])
        _load_optimizer(self._local_optimizer(), state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])

    def _optimizer_difference(self, state: dict, path: Path) -> str | None:
        """What keeps the saved optimizer and scheduler states from loading into this
        run's (another grouping of the parameters, a scheduler given on one side only);
        ``None`` if they fit."""
        saved, groups = state["optimizer"], self._local_optimizer().param_groups
        saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(saved_groups, list) or not isinstance(saved.get("state"), dict):
            return f"{path} holds no optimizer state_dict"
        saved_class, mine = state.get("optimizer_class"), _class_name(self._local_optimizer())
        if saved_class is not None and saved_class != mine:  # absent from older checkpoints
            return (f"{path} was saved with a {saved_class} and this run's optimizer is a "
                    f"{mine}: build the optimizer as the run that saved it did")
        if len(saved_groups) != len(groups):
            return (f"{path}: its optimizer has {len(saved_groups)} parameter group(s), this "
                    f"run's {len(groups)}: build the optimizer as the run that saved it did")
        for i, (here, there) in enumerate(zip(groups, saved_groups)):
            saved_params = there.get("params") if isinstance(there, dict) else None
            if not isinstance(saved_params, list):
                return f"{path}: its optimizer's parameter group {i} lists no parameters"
            if len(here["params"]) != len(saved_params):
                return (f"{path}: its optimizer's parameter group {i} holds "
                        f"{len(saved_params)} parameters, this run's "
                        f"{len(here['params'])}: build the optimizer as the run that saved it did")
        if (self.scheduler is None) != (state["scheduler"] is None):
            saved_with = "without" if state["scheduler"] is None else "with"
            given = "passes one" if self.scheduler is not None else "passes none"
            return (f"{path} was saved {saved_with} an LR scheduler and this run {given}: "
                    "pass scheduler= as the run that saved it did")
        return None

    def _model_difference(self, saved: dict, path: Path) -> str | None:
        """What keeps ``saved`` (a model state dict) from loading into the model, naming
        the first parameter that differs; ``None`` if it fits."""
        current = self.model.state_dict()
        for name, tensor in current.items():
            if name not in saved:
                return f"{path} is of another model: it has no {name!r}"
            mine = local_tensor(tensor)
            if tuple(saved[name].shape) != tuple(mine.shape) or saved[name].dtype != mine.dtype:
                return (f"{path} is of another model: {name!r} is {saved[name].dtype} "
                        f"{tuple(saved[name].shape)} there, {mine.dtype} {tuple(mine.shape)} here")
        extra = sorted(set(saved) - set(current))
        if extra:
            return f"{path} is of another model: it has {extra[0]!r}, which this model has not"
        return None

    @torch.no_grad()
    def _load_model(self, saved: dict | None, *, own: bool) -> None:
        """In place (DDP, FSDP2 and the buckets keep their tensors); rank 0's shared copy
        is broadcast."""
        for name, tensor in self.model.state_dict().items():
            mine = local_tensor(tensor)
            if saved is not None:
                mine.copy_(saved[name])
            if not own and self._world() > 1:
                src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                dist.broadcast(mine, src=src, group=self.group)


class _SaveWhenJoined(JoinHook):
    """The checkpointer's part in ``Join``: the handle's stand-in steps save (see
    ``AveragingHandle.add_joined_step_hook``); after the block, saving is as before."""

    def __init__(self, checkpointer: RoundCheckpointer, remove) -> None:
        self._checkpointer, self._remove = checkpointer, remove

    def post_hook(self, is_last_joiner: bool) -> None:
        self._remove()
        self._checkpointer._join_config = _JoinConfig.construct_disabled_join_config()
