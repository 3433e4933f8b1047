"""The one-line explanations the Atropos source logs when it gets no usable
batch (``atropos.py`` decides when; this module only words them): a long
wait (what the API knows of environments), a ``/batch`` that answered 500,
and a batch whose every group was dropped. Plain functions, no state."""

from __future__ import annotations

from typing import Any, Callable

Ask = Callable[..., Any]
"""``ask(method, path, body=None)``: the API's JSON answer, or None when it gave none."""

LOST_BATCH = ("Atropos API at %s answered /batch with HTTP 500 and lost that batch (%d so far): most likely a "
              "group with a non-finite score (NaN or inf), which it cannot encode as JSON; check the environments' "
              "scores")
"""atroposlib 0.4 takes a batch off its queue before it encodes it: an
encoding error drops the batch, and the trainer sees only the 500."""


def idle_hint(ask: Ask, url: str, batch_size: int, waited_s: float) -> str:
    """Why no batch came for ``waited_s`` seconds although the API answers,
    from what it says: an environment registered (``/status-env`` of the
    first environment id answers only once one has; atroposlib has no route
    that lists them), a group ever posted (``/latest_example``), the queue
    (``/status``)."""
    registered = isinstance(ask("GET", "/status-env", {"env_id": 0}), dict)
    latest = ask("GET", "/latest_example")
    posted = isinstance(latest, dict) and bool(latest.get("tokens"))
    status = ask("GET", "/status")
    queue = status.get("queue_size", "?") if isinstance(status, dict) else "?"
    if not registered and not posted:
        why = ("no environment has registered with it (/register-env) or posted a group: start one "
               "(examples/atropos/README.md)")
    elif not posted:
        why = ("an environment has registered but none has posted a scored group yet (can it reach its "
               "inference servers?)")
    else:
        why = (f"groups have been posted ({queue} queued now; a batch takes {batch_size} sequences): an "
               "environment may have stopped or be slow")
    return f"no batch from Atropos at {url} for {waited_s:.0f}s: {why}; still waiting"


def skipped_batch(num_groups: int, dropped: dict[str, int], constant: int, example: str) -> str:
    """A batch with no sample left: how many groups, dropped for what (``dropped``
    per kind), filtered as constant, and the first reason of the batch."""
    reasons = [f"{n} {kind}" for kind, n in dropped.items() if n]
    if constant:
        reasons.append(f"{constant} constant (grpo.filter_constant_groups)")
    detail = f"; first: {example}" if example else ""
    return (f"skipped an Atropos batch: none of its {num_groups} groups can be trained ({', '.join(reasons)}"
            f"{detail}); no step taken, pulling the next batch")
