"""The receive side of weight updates: receiving, checking and installing.

How a served model takes new weights, whatever protocol carried the update:
:func:`post_receive` / :func:`receive_weights` take an update's bytes off a
weight group, :class:`PendingVersion` gathers one session's updates so they
load as one version, and :func:`install_weights` puts tensors into the
model's parameters. The engine is reached only through :class:`WeightTarget`
(what ``Engine`` offers), so this module never imports ``server/engine/engine.py``: the
engine imports it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from torchtitan_grpo.server.engine.requests import WeightUpdateError
from torchtitan_grpo.weight_sync.buckets import TensorSpec, misaligned_message, unpack

SpecCheck = Callable[[Sequence[TensorSpec]], None]
"""What an update's metadata must pass to be loaded (``Engine.check_weights``)."""


class WeightTarget(Protocol):
    """What receiving and loading need of the model's owner (``Engine``)."""

    def check_received(self, specs: Sequence[TensorSpec], device: torch.device) -> list[bool]: ...

    def load_weights(
        self, named: Sequence[tuple[str, torch.Tensor]], weight_version: str | None = None,
        checked: bool = False, adopt: Sequence[bool] | None = None,
    ) -> None: ...

    def set_weight_version(self, version: str) -> None: ...


@dataclass
class PendingVersion:
    """What one weight-update session has received (SGLang's begin..end,
    vLLM's start..finish), loaded as one version when it ends: generation
    never runs on half of a version, and a session with a failed update
    loads nothing. Costs one model copy of memory while the session is open."""

    parts: list[tuple[Any, Sequence[bool] | None]] = field(default_factory=list)
    """The checked updates in arrival order, each ``(named, adopt flags or
    None)``; ``named`` is a :class:`PostedReceive` whose views are cut
    after its reply (``?ack=posted``), read once it has been waited for."""
    version: str | None = None
    error: str = ""
    """The first failure; once set, the session can only fail."""
    posted: list[PostedReceive] = field(default_factory=list)
    """Updates kept while their bytes were still arriving, waited for at
    ``load``. A failed session keeps them too: their buffers stay allocated
    while a receive may still write into them, and ``in_flight`` still tells
    a group's destroy that it must abort first."""

    def keep(self, named: Sequence[tuple[str, torch.Tensor]], version: str | None = None,
             adopt: Sequence[bool] | None = None, posted: PostedReceive | None = None) -> None:
        """Add a checked update (later tensors of a name win), with
        ``check_received``'s flags if it ran; ``posted``: its receive, when
        its bytes may still be arriving (its ``named`` are read at ``load``:
        they may not be cut yet)."""
        if posted is not None and posted.posted:
            self.posted.append(posted)
        self.parts.append((posted if posted is not None else named, adopt))
        if version is not None:
            self.version = version

    @property
    def received_any(self) -> bool:
        """Whether any update has been kept since the session began (or failed)."""
        return bool(self.parts)

    def fail(self, why: str) -> None:
        """Forget what was received; the first failure is the one reported."""
        self.parts, self.version = [], None
        self.error = self.error or why

    def in_flight(self, group: Any) -> bool:
        """Whether a receive of this session on ``group`` is still incomplete."""
        return any(p.group is group and p.in_flight() for p in self.posted)

    def load(self, engine: WeightTarget, version: str | None = None) -> int:
        """Wait for the bytes still arriving (what is to be loaded is listed
        meanwhile: ~0.2 ms for 398 tensors on an H200 host, otherwise after
        the last byte), then load everything received
        into ``engine`` under ``version`` (or the one an update carried) and
        return how many tensors; a session that received only a version just
        sets it (no wait for running requests). Raises
        :class:`WeightUpdateError`, model unchanged, if the session failed
        (a receive cut short by its group's abort included)."""
        waiting = self.posted if not self.error else []  # a failed session waits for nothing
        for p in waiting:
            p.cut_views()  # if not cut yet: the list below is made while the bytes arrive
        received: dict[str, torch.Tensor] = {}
        flags: dict[str, bool] = {}
        for part, adopt in self.parts:
            named = part.named if isinstance(part, PostedReceive) else part
            received.update(named)
            if adopt is not None and len(adopt) == len(named):
                flags.update(zip((n for n, _ in named), adopt))
            else:
                for n, _ in named:
                    flags.pop(n, None)
        named = list(received.items())
        adopt = [flags[n] for n, _ in named] if len(flags) == len(named) else None
        for p in waiting:
            try:
                p.wait()
            except Exception as e:  # noqa: BLE001 - an aborted group, a gloo timeout, a view not cut
                self.fail(f"a receive did not complete: {type(e).__name__}: {e}")
        if self.error:
            raise WeightUpdateError(f"nothing loaded (model unchanged): {self.error}")
        version = self.version if version is None else version
        if named:  # each update was checked when it was received
            engine.load_weights(named, version, checked=True, adopt=adopt)
        elif version is not None:
            engine.set_weight_version(version)
        return len(named)


def install_weights(params: dict[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]],
                    adopt: Sequence[bool] | None = None) -> None:
    """Make ``params[name]`` hold the values of each received tensor.

    A received tensor that already has the parameter's dtype, shape and
    device, and is contiguous, *becomes* the parameter's storage (``.data``
    swap, no copy): the receive buffers were allocated for this update and
    nothing else refers to them. That saves a full-model device copy per
    update, which on an H200 costs about a fifth of the NCCL transfer itself.
    Anything else (a dtype cast, CPU tensors read from disk) is copied.
    Callers validate first and hold off generation (``Engine.exclusive``).

    ``adopt``: that decision per tensor, made already (``adoptable``, while
    the bytes arrived), so that loading a version is only the swaps: the
    checks cost ~1 ms for 399 tensors on the H200 host, at a version's end.
    """
    with torch.no_grad():
        if adopt is not None:
            if len(adopt) != len(named):  # before the first swap: never half a version
                raise ValueError(f"{len(adopt)} adopt flags for {len(named)} tensors")
            for (name, t), own in zip(named, adopt):
                if own:
                    params[name].data = t
                else:
                    params[name].copy_(t)
            return
        for name, t in named:
            target = params[name]
            if (t.dtype == target.dtype and t.shape == target.shape and t.device == target.device
                    and t.is_contiguous() and not t.requires_grad and target._base is None):
                target.data = t  # a tied alias (same Parameter object) follows
            else:
                target.copy_(t)


def check_specs(params: dict[str, torch.Tensor], specs: Sequence[TensorSpec]) -> None:
    """Raise :class:`WeightUpdateError` naming the first tensor that does not
    fit the model whose tensors are ``params`` (unknown name, shape mismatch,
    duplicate): checked on the metadata alone, before any byte is loaded."""
    seen: set[str] = set()
    for s in specs:
        target = params.get(s.name)
        if target is None:
            raise WeightUpdateError(f"unknown parameter {s.name!r}: the model has no tensor of that name")
        if tuple(target.shape) != tuple(s.shape):
            raise WeightUpdateError(
                f"shape mismatch for {s.name!r}: received {list(s.shape)}, model has {list(target.shape)}"
            )
        if s.name in seen:
            raise WeightUpdateError(f"parameter {s.name!r} appears twice in one update")
        seen.add(s.name)


def adoptable(params: dict[str, torch.Tensor], specs: Sequence[TensorSpec], device: torch.device) -> list[bool]:
    """Per spec, whether a tensor received as it on ``device`` can become
    ``params[name]``'s storage in ``install_weights``. That holds for what
    ``receive_weights`` and ``receive_packed`` return (fresh contiguous
    tensors of the spec's dtype and shape, no autograd) when the dtype and
    device are the parameter's; the others are copied in."""
    out = []
    for s in specs:
        p = params.get(s.name)
        # a view (a per-expert slice of a fused MoE weight) is written into, never swapped
        out.append(p is not None and p.dtype == s.dtype and tuple(p.shape) == tuple(s.shape) and p.device == device
                   and p._base is None)
    return out


def receive_check(engine: WeightTarget, device: torch.device) -> tuple[SpecCheck, list[bool]]:
    """A ``check`` for ``receive_weights`` / ``receive_packed`` that also
    decides, while the bytes arrive, which tensors to adopt: the flags fill
    the returned list (in the specs' order) for ``PendingVersion.keep``."""
    flags: list[bool] = []

    def check(specs: Sequence[TensorSpec]) -> None:
        flags.extend(engine.check_received(specs, device))

    return check, flags


def run_check(check: SpecCheck | None, specs: Sequence[TensorSpec]) -> Exception | None:
    """``check(specs)``'s exception, returned to be raised once the receive is
    done: a receive must complete even when its update is refused, or the
    group falls out of step with the sender."""
    if check is None:
        return None
    try:
        check(specs)
    except Exception as e:  # noqa: BLE001 - raised by the caller after the receive
        return e
    return None


@dataclass
class PostedReceive:
    """One update whose receive is posted: ``named`` hold its values once
    :meth:`wait` has returned. The built-in server acknowledges an update at
    this point and loads it at the session's end, after ``wait``: a trainer
    that sends the next bucket once the reply is in then finds its receive
    already posted, and the link never idles between buckets."""

    named: list[tuple[str, torch.Tensor]]
    group: Any
    posted: list[Any] = field(default_factory=list)
    """``Posted`` handles of the receives (and copies) still to wait for."""
    finish: Callable[[], None] | None = None
    """Work that needs the bytes and could not be queued behind them (on
    CPU: copying unaligned tensors out of a packed chunk); run by ``wait``."""
    cut: Callable[[], list[tuple[str, torch.Tensor]]] | None = None
    """The views still to cut (``named``'s values), left for after the
    reply: ~20 us of Python per tensor, which would hold back an update
    answered once posted (``check_first``). :meth:`cut_views` runs it."""
    cut_error: Exception | None = None

    def in_flight(self) -> bool:
        """Whether some receive of it has not completed yet (never blocks)."""
        return any(not p.done() for p in self.posted)

    def cut_views(self) -> bool:
        """Cut the views now if they were left for later (on the transfer
        thread, while the bytes arrive); whether there were any to cut.
        Never raises: :meth:`wait` does."""
        if self.cut is None:
            return False
        cut, self.cut = self.cut, None
        try:
            self.named = cut()
        except Exception as e:  # noqa: BLE001 - raised by ``wait``
            self.cut_error = e
        return True

    def wait(self) -> list[tuple[str, torch.Tensor]]:
        """Block until every byte is in and return ``named``; raise
        RuntimeError if the group was aborted meanwhile (what arrived is
        incomplete)."""
        self.cut_views()
        for p in self.posted:
            p.wait()
        self.posted = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        check_not_aborted(self.group)
        if self.cut_error is not None:
            raise self.cut_error
        return self.named


def post_receive(group: Any, specs: Sequence[TensorSpec], flattened: bool,
                 check: SpecCheck | None = None, check_first: bool = False,
                 layout: FlatLayout | None = None) -> PostedReceive:
    """Post the receive of one update from rank 0 of ``group`` (a
    WeightGroup) and return without waiting for its bytes where it can.

    Flattened mode posts a single uint8 broadcast of all bytes and slices it
    (offsets must be itemsize-aligned); it returns once the broadcast is
    posted, the views cut and ``check`` (``Engine.check_weights``) passed.
    By default the check runs while the bytes arrive, and an update it
    refuses still receives its bytes, then raises: a sender that broadcasts
    once the request is out stays in step. ``check_first``: for a sender
    that broadcasts only once the update is answered, the update is refused
    before anything is posted. Per-tensor mode (one broadcast per spec, in
    order) returns complete. With ``check_first`` the reply need not wait
    for the views either: they are cut by ``PostedReceive.cut_views`` (the
    server queues it on the transfer thread after the reply) or ``wait``.
    ``layout``: ``FlatLayout.of(specs)``, kept by a caller that receives the
    same bucket every version.
    """
    if flattened:
        layout = layout if layout is not None else FlatLayout.of(specs)
        if check_first and (error := layout.misaligned or run_check(check, specs)) is not None:
            raise error  # nothing posted
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=group.device)
        stream = torch.cuda.current_stream(buf.device) if buf.device.type == "cuda" else None
        posted = group.post_broadcast(buf, src=0, stream=stream)
        names = layout.names
        if check_first:
            return PostedReceive([], group, [posted], cut=lambda: list(zip(names, unpack(buf, specs))))
        # The views are cut and the metadata checked while the bytes arrive
        # (a few ms of Python for a few hundred tensors).
        try:
            views = unpack(buf, specs)
        except ValueError as e:
            views, error = [], WeightUpdateError(str(e))
        else:
            error = run_check(check, specs)
        if error is not None:
            posted.wait()  # nothing returns before a refused receive is done
            check_not_aborted(group)
            raise error
        return PostedReceive(list(zip(names, views)), group, [posted])
    if check_first and (error := run_check(check, specs)) is not None:
        raise error
    out = []
    for s in specs:
        t = torch.empty(s.shape, dtype=s.dtype, device=group.device)
        group.broadcast(t, src=0)
        out.append((s.name, t))
    check_not_aborted(group)
    error = run_check(check, specs) if not check_first else None
    if error is not None:
        raise error
    return PostedReceive(out, group)


@dataclass(frozen=True)
class FlatLayout:
    """What posting a flattened bucket's receive needs from its specs beyond
    the specs themselves, worked out in one pass: a server that sees the same
    bucket every version keeps it (~0.3 ms of Python for 269 tensors, ahead
    of the post on every version otherwise)."""

    names: list[str]
    nbytes: int
    """The bucket's size: its tensors' bytes back to back."""
    misaligned: WeightUpdateError | None
    """Why ``unpack`` could not cut it into views (a tensor at an offset that
    is no multiple of its itemsize), found by arithmetic alone (no buffer,
    no view); None if it can."""

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> FlatLayout:
        pos, error = 0, None
        for s in specs:
            if error is None and pos % s.itemsize:
                error = WeightUpdateError(misaligned_message(s, pos))
            pos += s.nbytes
        return cls([s.name for s in specs], pos, error)


def receive_weights(group: Any, specs: Sequence[TensorSpec], flattened: bool,
                    check: SpecCheck | None = None) -> list[tuple[str, torch.Tensor]]:
    """Receive one update from rank 0 of ``group`` completely
    (:func:`post_receive`, then its ``wait``)."""
    return post_receive(group, specs, flattened, check).wait()


def check_not_aborted(group: Any) -> None:
    """After a receive: an NCCL receive that the group's abort ended (a destroy
    of a group whose sender is gone) returns without an error, its bytes
    incomplete; it must not count as received."""
    if getattr(group, "closed", False):
        raise RuntimeError(f"weight group {getattr(group, 'group_name', '?')!r} was aborted during the receive; "
                           "what arrived is incomplete")


def read_safetensors_dir(path: str, device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """All tensors of the ``*.safetensors`` files in ``path``, on ``device``,
    in memory of their own (on CPU safetensors maps the file: a tensor would
    change if the file were rewritten in place, so it is copied out)."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise WeightUpdateError(f"model_path {path!r} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {path!r}")
    out = []
    for f in files:
        with safe_open(f, framework="pt", device=str(device)) as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                out.append((k, t.clone() if t.device.type == "cpu" else t))
    return out
