"""An outer optimizer over any averaging hook: DiLoCo / SlowMo-style training.

Local SGD applies the average of the replicas as it is. DiLoCo (Douillard et al.,
2023) and SlowMo (Wang et al., 2020) instead treat the averaged change as a gradient
for a second, *outer* optimizer over the globally shared parameters. Per bucket and
round, with ``anchor`` the parameters as of the last round (identical on every rank)::

    avg    = inner_hook(inner_state, bucket)     # the average (or a compressed average)
    g      = anchor - avg                        # the outer pseudo-gradient
    theta  = anchor                              # the bucket's outer parameter
    outer_optimizer.step()                       # a real torch.optim optimizer, theta.grad = g
    new    = theta                               # becomes the parameters and the next anchor

With ``SGD(lr=1)`` and no momentum the result is the inner hook's average itself; the
DiLoCo defaults are ``SGD(lr=0.7, momentum=0.9, nesterov=True)``. Every rank gets the
same ``avg`` and so takes the same outer step: the outer optimizer's state (momentum,
Adam moments) is identical on every rank, and the parameters stay identical after a
round.

Tuning: in steady state Nesterov momentum ``m`` at outer lr ``lr`` moves the parameters
by up to ``lr / (1 - m)`` times a round's averaged change (7x with DiLoCo's defaults), so
the inner optimizer wants a smaller learning rate than plain training: tune it for the
outer step, starting a few times below the learning rate that suits plain DDP.

Design notes:

* One outer optimizer **per bucket** (``state.optimizers[bucket.index()]``), stepped in
  that bucket's future callback as soon as its average arrives: no bucket waits for
  another, and callbacks of different buckets (which gloo may run on different threads)
  never touch the same optimizer. To schedule the outer learning rate, attach a
  scheduler to each of them.
* The outer parameter is a copy of the bucket's anchor (one copy of the bucket, plus the
  optimizer's own state), refreshed from ``bucket.anchor()`` at every round, so it
  follows whatever the registry does to the anchor (the reset at the end of warm-up, a
  loaded checkpoint). It has the bucket's dtype. The pseudo-gradient is computed in the
  bucket's round scratch space (``bucket.workspace()``), so it costs no memory.
* Per-bucket structures are created eagerly by the hook's ``prepare_bucket`` (its
  :class:`~ddp_avg_hooks.HookSpec`; the registry calls it for every bucket at
  registration, :meth:`OuterOptimizerState.prepare` does the same by hand) or, failing
  that, at the bucket's first round. A state dict loaded before then is kept and applied
  when the bucket is prepared.
* If a round fails after some buckets stepped (a later bucket raised, ``check_finite``),
  those buckets' optimizer state has advanced although no parameter changed, as with
  the error-feedback memory of the compressed hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .._groups import group_of_state, is_member, or_world
from ..bucket import ParamBucket
from ..collectives import tracked_then
from ..protocol import HookSpec, SPEC_ATTRIBUTE, hook_name, hook_spec
from ..trees import clone_tree
from ._per_bucket import PerBucket

#: DiLoCo's outer optimizer, SGD with Nesterov momentum (Douillard et al., 2023).
DILOCO_DEFAULTS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


class _BucketOuter:
    """The outer parameter of one bucket and the optimizer stepping it."""

    __slots__ = ("param", "optimizer")

    def __init__(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.param = param
        self.optimizer = optimizer


class OuterOptimizerState:
    """State of :func:`outer_optimizer`: the inner hook's state and the outer optimizers.

    Args:
        inner_state: the state the inner hook takes (``None``, a ``ProcessGroup``, a
            :class:`~ddp_avg_hooks.hooks.HalfDeltaState`, a
            :class:`~ddp_avg_hooks.hooks.PowerSGDState`, ...). Its process group is
            the one this state reports as ``process_group``.
        optimizer: the outer optimizer. ``None`` (default): ``torch.optim.SGD`` with
            DiLoCo's ``lr=0.7, momentum=0.9, nesterov=True``, each overridable by
            ``optimizer_kwargs`` (``momentum=0`` alone turns Nesterov off too). A
            ``torch.optim.Optimizer`` subclass: called as
            ``optimizer(params, **optimizer_kwargs)``. Any other callable: a factory
            ``optimizer(params) -> torch.optim.Optimizer`` (no ``optimizer_kwargs``).
            It is called once per bucket, with a list holding that bucket's outer
            parameter.
        **optimizer_kwargs: hyperparameters for the outer optimizer.

    The options are checked at once by building the optimizer over a probe tensor, so
    a bad hyperparameter fails here, with the optimizer's own message.
    ``state_dict()`` holds every bucket's outer optimizer state and the inner state's
    ``state_dict()`` if it has one, so ``handle.state_dict()`` checkpoints both.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks.hooks import OuterOptimizerState, PowerSGDState
        >>> OuterOptimizerState().optimizer_name, OuterOptimizerState().optimizer_kwargs
        ('SGD', {'lr': 0.7, 'momentum': 0.9, 'nesterov': True})
        >>> state = OuterOptimizerState(PowerSGDState(), torch.optim.Adam, lr=1e-2)
        >>> sorted(state.state_dict())
        ['buckets', 'inner', 'optimizer']
        >>> OuterOptimizerState(lr=-1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: OuterOptimizerState: the outer optimizer rejects its options: Invalid ... -1.0
    """

    __slots__ = ("inner_state", "optimizer_name", "optimizer_kwargs", "_factory", "_buckets",
                 "_hyperparameters")

    def __init__(self, inner_state=None, optimizer=None, **optimizer_kwargs) -> None:
        if optimizer is None:
            kwargs = {**DILOCO_DEFAULTS, **optimizer_kwargs}
            if "nesterov" not in optimizer_kwargs and not kwargs["momentum"]:
                kwargs["nesterov"] = False  # SGD rejects Nesterov without momentum
            factory = functools.partial(torch.optim.SGD, **kwargs)
            name = "SGD"
        elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            kwargs = dict(optimizer_kwargs)
            factory = functools.partial(optimizer, **kwargs)
            name = optimizer.__name__
        elif callable(optimizer):
            if optimizer_kwargs:
                raise TypeError(
                    "OuterOptimizerState: optimizer_kwargs "
                    f"{sorted(optimizer_kwargs)} go with an optimizer class; a factory must "
                    "set them itself, e.g. lambda params: torch.optim.SGD(params, lr=0.7)"
                )
            kwargs, factory, name = {}, optimizer, None
        else:
            raise TypeError(
                "OuterOptimizerState: optimizer must be None (DiLoCo's SGD), a "
                "torch.optim.Optimizer subclass or a factory params -> Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        try:
            probe = factory([torch.zeros(1)])
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"OuterOptimizerState: the outer optimizer rejects its options: {exc}"
            ) from exc
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError(
                "OuterOptimizerState: the optimizer factory must return a "
                f"torch.optim.Optimizer, got {type(probe).__name__}"
            )
        self.inner_state = inner_state
        self.optimizer_name = name or type(probe).__name__
        self.optimizer_kwargs = kwargs
        # the hyperparameters as the optimizer holds them (a factory's too)
        self._hyperparameters = {k: v for k, v in probe.defaults.items()
                                 if isinstance(v, (bool, int, float, str, tuple, type(None)))}
        self._factory: Callable = factory
        self._buckets: PerBucket[_BucketOuter] = PerBucket(
            "OuterOptimizerState", create=self._create, numel=lambda o: o.param.numel(),
            save=lambda o: clone_tree(o.optimizer.state_dict()),
            load=lambda o, entry: o.optimizer.load_state_dict(clone_tree(entry)))

    def settings(self) -> dict:
        """The outer optimizer's class and hyperparameters: what every rank must share."""
        return {"optimizer": self.optimizer_name, **self._hyperparameters}

    @property
    def process_group(self):
        """The inner state's process group (``None``: the default group)."""
        return group_of_state(self.inner_state)

    @property
    def optimizers(self) -> dict[int, torch.optim.Optimizer]:
        """The outer optimizer of every prepared bucket, by ``bucket.index()``."""
        return {i: b.optimizer for i, b in self._buckets.items()}

    def prepare(self, bucket: ParamBucket) -> None:
        """Create ``bucket``'s outer parameter and optimizer now (idempotent).

        Applies a state dict loaded earlier for this bucket, if any.
        """
        self.outer(bucket)

    def outer(self, bucket: ParamBucket) -> _BucketOuter:
        """``bucket``'s outer parameter and optimizer (``.param``, ``.optimizer``), made on
        first use."""
        return self._buckets.get(bucket)

    def _create(self, bucket: ParamBucket) -> _BucketOuter:
        param = bucket.stored_anchor().detach().clone()  # host memory when offloaded
        return _BucketOuter(param, self._factory([param]))

    # --- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Outer optimizer state per bucket index (cloned) and the inner state's, if any."""
        out = {"optimizer": self.optimizer_name, "buckets": self._buckets.state_dict()}
        if hasattr(self.inner_state, "state_dict"):
            out["inner"] = self.inner_state.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (before or after the first round)."""
        saved = state_dict["optimizer"]
        if saved != self.optimizer_name:
            raise ValueError(
                f"OuterOptimizerState.load_state_dict: the checkpoint's outer optimizer is "
                f"{saved}, this state's {self.optimizer_name}; use the same optimizer to resume"
            )
        has_inner = hasattr(self.inner_state, "load_state_dict")
        if has_inner != ("inner" in state_dict):
            raise ValueError(
                "OuterOptimizerState.load_state_dict: the checkpoint "
                + ("has no inner state but this inner state needs one" if has_inner
                   else "has an inner state but this inner state takes none")
            )
        if has_inner:
            self.inner_state.load_state_dict(state_dict["inner"])
        self._buckets.load_state_dict(state_dict["buckets"])

    def __repr__(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.optimizer_kwargs.items())
        return (f"OuterOptimizerState(inner_state={self.inner_state!r}, "
                f"optimizer={self.optimizer_name}({kwargs}), buckets={len(self._buckets)})")


def _check_state(state, name: str) -> None:
    if not isinstance(state, OuterOptimizerState):
        raise TypeError(
            f"{name}: state must be an OuterOptimizerState(inner_state, ...) holding the "
            f"inner hook's state, got {type(state).__name__}; register with "
            "register_averaging_hook(ddp, outer_optimizer(inner_hook), "
            "OuterOptimizerState(inner_state))"
        )


def outer_optimizer(inner_hook: Callable) -> Callable:
    """Turn an averaging hook into DiLoCo / SlowMo: an outer optimizer steps on its average.

    Per bucket and round (see the module docstring): ``avg = inner_hook(...)``, the
    pseudo-gradient ``anchor - avg`` is handed to a real ``torch.optim`` optimizer over
    the bucket's outer parameter (the anchor), and the new parameters are the outer
    parameter after its step. ``SGD(lr=1)`` without momentum gives ``avg`` itself.
    Works with every hook of this package, including the compressed ones (the
    pseudo-gradient is then the compressed average's).

    Args:
        inner_hook: any averaging hook ``hook(state, bucket) -> Future[Tensor]``.

    Returns:
        A hook to register with an :class:`OuterOptimizerState` holding the inner hook's
        state. It keeps anchors (``needs_anchor``), validates its state (and the inner
        one, with the inner hook's ``validate_state``), and creates the per-bucket
        optimizers at registration (``prepare_bucket``). Ranks outside the inner
        state's process group get the inner hook's result unchanged.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        >>> hook = dah.hooks.outer_optimizer(dah.hooks.fp16_compress_hook)
        >>> state = dah.hooks.OuterOptimizerState(dah.hooks.HalfDeltaState())  # DiLoCo's SGD
        >>> handle = dah.register_averaging_hook(ddp, hook, state, period=4, optimizer=opt)
        >>> for _ in range(8):
        ...     opt.zero_grad(); ddp(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> handle.stats.rounds, sorted(state.optimizers)
        (2, [0])
        >>> "momentum_buffer" in state.state_dict()["buckets"][0]["state"][0]
        True
        >>> handle.remove(); dist.destroy_process_group()
    """
    if not callable(inner_hook):
        raise TypeError(
            f"outer_optimizer: inner_hook must be callable, got {type(inner_hook).__name__}"
        )
    name = f"outer_optimizer({hook_name(inner_hook)})"
    inner_spec = hook_spec(inner_hook)

    def hook(state: OuterOptimizerState, bucket: ParamBucket) -> torch.futures.Future:
        _check_state(state, name)
        inner_fut = inner_hook(state.inner_state, bucket)
        if not is_member(or_world(state.process_group)):
            return inner_fut  # not averaging here: leave the parameters alone
        # an inner result that is the averaged change is the pseudo-gradient itself;
        # this hook returns new values either way
        inner_gives_change = bucket.result_is_delta
        bucket.mark_result_as_values()
        outer = state.outer(bucket)
        anchor = bucket.stored_anchor()  # host memory with offload_state=True: step there
        scratch = None if bucket.offloaded else bucket.workspace()

        def outer_step(fut: torch.futures.Future) -> torch.Tensor:
            average = fut.value()
            if not isinstance(average, torch.Tensor) or average.numel() != bucket.numel():
                return average  # let the registry report what the inner hook returned
            average = average.reshape(-1)
            if scratch is None:
                average = average.to(anchor.device)
                grad = average.to(anchor.dtype, copy=True) if inner_gives_change \
                    else torch.sub(anchor, average)
            elif inner_gives_change:
                grad = scratch.copy_(average)
            else:
                grad = torch.sub(anchor, average, out=scratch)  # pseudo-gradient
            outer.param.copy_(anchor)
            outer.param.grad = grad
            try:
                outer.optimizer.step()
            finally:
                outer.param.grad = None
            return outer.param

        return tracked_then(inner_fut, outer_step)

    def validate_state(state) -> None:
        _check_state(state, name)
        try:
            inner_spec.validate(state.inner_state)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: the inner state, OuterOptimizerState's first argument, "
                            f"is not one the inner hook takes: {exc}") from exc

    def prepare_bucket(state, bucket: ParamBucket) -> None:
        inner_spec.prepare(state.inner_state, bucket)
        state.prepare(bucket)

    def settings(state) -> dict:
        inner = inner_spec.settings_of(state.inner_state)
        return {**{f"outer_{k}": v for k, v in state.settings().items()},
                **{f"inner_{k}": v for k, v in inner.items()}}

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"{name}: see :func:`ddp_avg_hooks.hooks.outer_optimizer`."
    setattr(hook, SPEC_ATTRIBUTE, HookSpec(needs_anchor=True, validate_state=validate_state,
                                           prepare_bucket=prepare_bucket, settings=settings))
    return hook
