"""Rollout router replay (R3): the trainer's MoE routers use the experts the
inference engine picked.

Without replay, a token whose router picks a different expert in the trainer
than at inference gets a logprob from a different network, and its importance
ratio means nothing. With replay, every routed token goes to the engine's
experts; the gate weights (the scores) still come from the trainer's own gate
output at those experts, normalised as the model normally does, so the gate
keeps getting gradients.

Pieces:

* :class:`ReplayRouter`: TorchTitan's ``TokenChoiceTopKRouter`` with a forward
  that can take given expert ids. :func:`torchtitan_grpo.models.qwen3_moe.prepare`
  swaps every MoE layer's router to it when the model is built (before any
  parallelisation), so the replay state (``replay_routes``, ``replay_chunk``)
  lives on the router modules themselves and survives FSDP / TP / EP, which
  wrap or hook modules but keep their attributes.
* :func:`replay`: context manager that hands each router its layer's routes.
* :func:`routes_tensor`: the routes of a padded micro-batch, from
  ``Sample.routed_experts``, aligned with the trainer's input tokens.

Routes layout: an int tensor ``[rows, T, num_moe_layers, top_k]`` aligned with
the model's input ``tokens [rows, T]``: ``routes[r, t, l]`` are the experts
MoE layer ``l`` (model order; every Qwen3-MoE layer is an MoE layer here) uses
for the token at input position ``t`` of row ``r``. A position whose ids are
all -1 routes normally (prompt tokens the engine gave no route for, padding,
a sequence's last token).

Pipeline parallelism: a stage keeps the whole model's layer FQNs
(``layers.17...``), so every router knows its global layer id and takes
``routes[:, :, layer_id]`` itself: give each stage the *whole* routes tensor
(all layers); nothing is sliced by hand. A PP schedule runs a stage's forward
once per micro-batch on ``rows / n_microbatches`` rows; the router then needs
to know which micro-batch runs: call :func:`set_chunk` with the schedule's
chunk id before each ``forward_one_chunk`` *and* each ``backward_one_chunk``
(activation checkpointing recomputes the forward inside the backward, which
must replay the same rows). A forward over all the rows (no PP) needs no chunk.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan_grpo  # noqa: F401  (installs the triton shim before torchtitan)
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

__all__ = ["ReplayRouter", "expert_counts", "moe_routers", "replay", "set_chunk", "routes_tensor"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert of ``indices [N, k]``.

    On GPUs TorchTitan's own ``histc`` (no device-to-host sync); on CPU
    ``histc`` is not implemented for integer tensors (torch 2.13), so
    ``bincount`` (the CPU has no sync to avoid). Both give integer counts,
    which the experts' for-loop path splits by."""
    flat = indices.reshape(-1)
    if flat.device.type == "cpu":
        return torch.bincount(flat, minlength=num_experts)
    return torch.histc(flat, bins=num_experts, min=0, max=num_experts)


class ReplayRouter(TokenChoiceTopKRouter):
    """Token-choice top-k router that replays given expert ids when told to.

    Without routes (``replay_routes is None``) it computes exactly what
    TorchTitan's router computes (same ops, same order). Set on the instance
    (never in ``__init__``: instances are converted by class swap):

    * ``replay_routes``: this layer's routes ``[rows, T, top_k]`` or None.
    * ``replay_chunk``: PP micro-batch index, see the module docstring.
    * ``keep_stats``: keep ``(scores [N, E] fp32, expert ids [N, k])`` of the
      last forward in ``last_stats`` for the auxiliary loss
      (:func:`torchtitan_grpo.models.qwen3_moe.aux_loss`).
    """

    replay_routes: torch.Tensor | None = None
    replay_chunk: int | None = None
    keep_stats: bool = False
    last_stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def _given(self, n_tokens: int) -> torch.Tensor | None:
        """The routes ``[n_tokens, k]`` (int64) of this forward's tokens, or None."""
        routes = self.replay_routes
        if routes is None:
            return None
        rows, length, k = routes.shape
        if n_tokens == rows * length:
            return routes.reshape(n_tokens, k).long()
        per_chunk = n_tokens // length
        if n_tokens % length or rows % per_chunk:
            raise ValueError(f"router replay: a forward over {n_tokens} tokens does not fit routes of "
                             f"{rows} rows x {length} positions")
        if self.replay_chunk is None:
            raise ValueError(f"router replay: a forward over {per_chunk} of the routes' {rows} rows needs "
                             "the micro-batch index (router_replay.set_chunk)")
        start = self.replay_chunk * per_chunk
        if start + per_chunk > rows:
            raise ValueError(f"router replay: micro-batch {self.replay_chunk} of {per_chunk} rows is past "
                             f"the routes' {rows} rows")
        return routes[start : start + per_chunk].reshape(n_tokens, k).long()

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, dim]`` -> (top scores [N, k], expert ids [N, k], tokens per expert [E])."""
        scores = self.gate(x)
        # scores in fp32, as TorchTitan's router (precision of the softmax)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        elif self.score_func == "softmax":
            scores = F.softmax(scores.to(torch.float32), dim=1)
        else:
            raise NotImplementedError(f"unknown score function {self.score_func}")
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            choice = self._get_node_limited_routing_scores(choice)
        _, selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        given = self._given(x.shape[0])
        if given is not None:
            selected = torch.where((given >= 0).all(dim=-1, keepdim=True), given, selected)
        # the gate values come from this router's own scores at the chosen
        # experts: under replay the gate still gets the policy gradient
        top_scores = scores.gather(dim=1, index=selected)
        if self._debug_force_load_balance:
            selected, top_scores = self._debug_force_load_balance_routing(scores)
        if self.keep_stats:
            self.last_stats = (scores, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected, expert_counts(selected, self.num_experts)


def moe_routers(model: nn.Module) -> list[tuple[int, ReplayRouter]]:
    """``(global layer id, router)`` of every MoE layer ``model`` holds (a PP
    stage: its own layers), in layer order. Wrappers (FSDP, activation
    checkpointing) keep ``layers.<id>.`` in the module names."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, TokenChoiceTopKRouter):
            if not isinstance(module, ReplayRouter):
                raise TypeError(f"{name} is a plain TorchTitan router: build the model with "
                                "torchtitan_grpo.models.hf_bridge.build_model (qwen3_moe.prepare)")
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"cannot tell the layer of MoE router {name}")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def _check_routes(routes: torch.Tensor, routers: list[tuple[int, ReplayRouter]]) -> None:
    if routes.dim() != 4 or routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"routes must be an int tensor [rows, T, num_moe_layers, top_k], got "
                         f"{routes.dtype} {tuple(routes.shape)}")
    layers, k = routes.shape[2], routes.shape[3]
    top_layer = max(layer for layer, _ in routers)
    router = routers[0][1]
    if top_layer >= layers or k != router.top_k:
        raise ValueError(f"routes hold {layers} layers x top_{k}; the model needs > {top_layer} layers "
                         f"x top_{router.top_k}")
    if routes.numel() and (int(routes.max()) >= router.num_experts or int(routes.min()) < -1):
        raise ValueError(f"routes hold expert ids outside [-1, {router.num_experts})")
    valid = routes >= 0
    if not bool((valid.all(-1) | ~valid.any(-1)).all()):
        raise ValueError("routes: a position must give all top_k experts or none (-1 everywhere)")


@contextlib.contextmanager
def replay(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside the block every MoE router of ``model`` routes the positions of
    ``routes [rows, T, num_moe_layers, top_k]`` (int, -1 = route normally) to
    the given experts; the model's input must be ``[rows, T]`` (or, under PP,
    micro-batches of its rows, see :func:`set_chunk`). Run the backward inside
    the block too when activations are checkpointed (the recompute routes
    again). ``routes=None`` routes normally (a no-op block)."""
    if routes is None:
        yield
        return
    routers = moe_routers(model)
    if not routers:
        raise ValueError("router replay: the model has no MoE layer")
    _check_routes(routes, routers)
    for layer, router in routers:
        device = router.gate.weight.device
        # kept in the given integer dtype (int16/int32 fit); the forward casts
        # its tokens' slice to int64 for gather
        router.replay_routes = routes[:, :, layer].to(device).contiguous()
        router.replay_chunk = None
    try:
        yield
    finally:
        for _, router in routers:
            router.replay_routes = None
            router.replay_chunk = None


def set_chunk(model: nn.Module, chunk: int | None) -> None:
    """Tell every router of ``model`` (a PP stage) which micro-batch of the
    routes' rows its next forward (or recompute) runs: chunk ``c`` of
    ``n`` equal micro-batches is rows ``[c * rows / n, (c + 1) * rows / n)``,
    the schedule's own split."""
    for _, router in moe_routers(model):
        router.replay_chunk = chunk


def routes_tensor(
    samples: Sequence,
    rows: int = 0,
    length: int = 0,
    placements: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor | None:
    """Routes ``[rows', T', layers, k]`` (int16, -1 = route normally) of a
    padded micro-batch, from each sample's ``routed_experts``.

    The layout is ``trainer._pack``'s: sample ``i`` in row ``i`` from position
    0 (its prompt then completion tokens, right padding), ``T' = max(longest
    sample, length, 2)``, ``rows' = max(len(samples), rows)``. Position ``t``
    of a sample gets ``routed_experts[t]`` (the engine ran tokens ``0 .. P+C-2``;
    its last token and every padding position route normally). Pass a longer
    ``length`` when the tokens were padded further (``parallel.pad_to_multiple``).

    ``placements``: ``(row, start)`` of each sample when several samples share
    a row (packed sequences); default ``(i, 0)``.

    Returns None when no sample has routes (replay then is a no-op). Samples
    without routes get -1 rows (they route normally).
    """
    placements = list(placements) if placements is not None else [(i, 0) for i in range(len(samples))]
    if len(placements) != len(samples):
        raise ValueError(f"{len(placements)} placements for {len(samples)} samples")
    shaped = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not shaped:
        return None
    layers, k = shaped[0].shape[1:]
    ends = [start + len(s.prompt_ids) + len(s.completion_ids) for s, (_, start) in zip(samples, placements)]
    T = max([*ends, length, 2])
    B = max([rows, *(r + 1 for r, _ in placements)])
    out = torch.full((B, T, layers, k), -1, dtype=torch.int16)
    for i, (s, (row, start)) in enumerate(zip(samples, placements)):
        if s.routed_experts is None:
            continue
        n = len(s.prompt_ids) + len(s.completion_ids) - 1
        got = tuple(s.routed_experts.shape)
        if got != (n, layers, k):
            raise ValueError(f"sample {i}: routed_experts has shape {got}, expected ({n}, {layers}, {k}) "
                             "(prompt + completion - 1 positions, layers, top_k)")
        out[row, start : start + n] = torch.as_tensor(s.routed_experts).to(torch.int16)
    return out
