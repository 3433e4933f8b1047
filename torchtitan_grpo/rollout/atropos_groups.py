"""Atropos's scored groups as the trainer's samples (the conversion half of
the Atropos source, ``atropos.py``; pure functions, no HTTP).

* **conversion** (:func:`convert_groups`, vectorised over the batch's
  concatenated sequences): each ``ScoredData`` group becomes
  one :class:`~torchtitan_grpo.train.sample.Sample` per sequence. ``masks`` holds
  ``-100`` for tokens that are not trained (prompt, environment and tool
  tokens) and the token id for trained ones; a sequence becomes
  ``prompt_ids`` = the tokens before its first trained token and
  ``completion_ids`` = from there to its last trained token, with
  ``loss_mask`` marking the trained ones (None when all are).
  ``inference_logprobs`` (aligned with ``tokens``, 1.0 on masked positions)
  become the rollout logprobs of the off-policy correction. Advantages are
  group-relative from ``scores`` with our ``[grpo]`` settings, or the group's
  own ``advantages`` when it sends them (per token: a sequence gets the mean
  over its trained tokens); ``overrides[i]["set_advantage_to_zero"]`` zeroes
  a sequence. ``overrides`` may also carry ``finish_reason`` (``"length"``
  feeds ``grpo.mask_truncated``) and ``weight_versions`` (the versions that
  generated the sequence, for ``grpo.max_staleness``; without them a sample
  counts as ``offpolicy/unknown_version`` and is kept).
* **malformed groups** are dropped, never fatal: lengths of tokens / masks /
  logprobs / advantages that differ, no trained token in a sequence, a
  sequence longer than the trainer's context, a token id outside the
  vocabulary, a non-finite score or a positive log-prob, no rollout log-probs
  for trained tokens. The first group of each kind is logged with its
  reason; every one is counted in ``atropos/dropped_<kind>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from torchtitan_grpo.rollout.advantages import constant_group_mask, group_advantages
from torchtitan_grpo.train.sample import Sample

MASKED = -100
"""Atropos's mask value of a token that is not trained."""
LOGPROB_PLACEHOLDER = 1.0
"""Atropos's ``inference_logprobs`` value on masked positions (no log-prob is 1.0)."""

MALFORMED_KINDS = ("shape", "all_masked", "too_long", "bad_value", "no_logprobs")
"""Why a group is dropped: lengths differ (or a group is empty), a sequence
with no trained token, a sequence longer than the context, a token id outside
the vocabulary / a non-finite score / a positive or non-finite log-prob, and
trained tokens without rollout log-probs."""


class Malformed(ValueError):
    """A group the trainer cannot train on; ``kind`` is one of :data:`MALFORMED_KINDS`."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


@dataclass
class ConvertedGroup:
    samples: list[Sample]
    """Empty when the group was filtered (``filter_constant_groups``)."""
    scores: list[float]
    constant: bool
    trained_tokens: int
    tokens: int
    """All tokens of the group's sequences (trained or not)."""
    truncated: int
    averaged_advantages: int = 0
    """Sequences whose per-token ``advantages`` differed over their trained tokens (their mean was used)."""
    temperatures: set[float] = field(default_factory=set)
    """Sampling temperatures the group says it used (``overrides`` / ``generation_params``)."""
    missing_logprob_tokens: int = 0
    """Trained tokens without a rollout log-prob (NaN; only with ``allow_missing_logprobs``)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_sequence(group: dict, key: str, n: int) -> list | None:
    """``group[key]`` as one entry per sequence, or None when absent. BaseEnv
    sends ``[]`` for a field none of its items had: absent too."""
    value = group.get(key)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) != n:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise Malformed("shape", f"'{key}' has {size} entries for {n} sequences")
    return value


def _flat_ints(values: list) -> np.ndarray | None:
    """``values`` (ints, as JSON gives them) as int64; None if any is not a
    plain int (bools and floats included) or does not fit."""
    if set(map(type, values)) <= {int}:
        try:
            return np.fromiter(values, dtype=np.int64, count=len(values))
        except OverflowError:
            return None
    return None


def _as_float(v: Any) -> float:
    """A log-prob as a float; NaN for what is not a number (flagged apart)."""
    try:
        return float(v) if _is_num(v) else math.nan
    except OverflowError:
        return math.inf


@dataclass
class _Checked:
    """A group whose structure passed: per-sequence lists of equal lengths."""

    index: int
    tokens: list
    masks: list
    scores: list
    logprobs: list | None
    advantages: list | None
    overrides: list
    group_overrides: dict
    generation_params: Any


def _check_structure(group: Any, index: int, max_len: int) -> _Checked:
    """The checks that need no per-token work: shapes, scores, lengths."""
    if not isinstance(group, dict):
        raise Malformed("shape", f"a group is {type(group).__name__}, not an object")
    tokens, masks, scores = group.get("tokens"), group.get("masks"), group.get("scores")
    if not isinstance(tokens, list) or not tokens:
        raise Malformed("shape", "no sequences ('tokens' is empty or missing)")
    n = len(tokens)
    for key, value in (("masks", masks), ("scores", scores)):
        if not isinstance(value, list) or len(value) != n:
            size = len(value) if isinstance(value, list) else "no"
            raise Malformed("shape", f"'{key}' has {size} entries for {n} sequences")
    logprobs = _per_sequence(group, "inference_logprobs", n)
    advantages = _per_sequence(group, "advantages", n)
    for i, s in enumerate(scores):
        if not _is_num(s) or not math.isfinite(s):
            raise Malformed("bad_value", f"score {i} is {s!r}")
    for i in range(n):
        toks, m = tokens[i], masks[i]
        if not isinstance(toks, list) or not isinstance(m, list) or not toks:
            raise Malformed("shape", f"sequence {i}: 'tokens' and 'masks' must be non-empty lists")
        if len(m) != len(toks):
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {len(m)} mask entries")
        if logprobs is not None and (not isinstance(logprobs[i], list) or len(logprobs[i]) != len(toks)):
            size = len(logprobs[i]) if isinstance(logprobs[i], list) else type(logprobs[i]).__name__
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {size} inference_logprobs")
        if advantages is not None and (not isinstance(advantages[i], list)
                                       or len(advantages[i]) not in (1, len(toks))):
            size = len(advantages[i]) if isinstance(advantages[i], list) else type(advantages[i]).__name__
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {size} advantages")
    if max_len:
        for i, toks in enumerate(tokens):
            if len(toks) > max_len:
                raise Malformed("too_long", f"sequence {i} has {len(toks)} tokens; the trainer takes at most {max_len}")
    overrides = group.get("overrides") or []
    group_overrides = group.get("group_overrides") or {}
    return _Checked(index, tokens, masks, scores, logprobs, advantages,
                    overrides if isinstance(overrides, list) else [],
                    group_overrides if isinstance(group_overrides, dict) else {}, group.get("generation_params"))


def convert_groups(groups: list, *, scale_rewards: bool = True, filter_constant_groups: bool = False,
                   max_len: int = 0, vocab_size: int = 0,
                   allow_missing_logprobs: bool = False) -> list[ConvertedGroup | Malformed]:
    """Atropos ``ScoredData`` groups (dicts, as ``/batch`` returns them) as
    trainer samples: one :class:`ConvertedGroup` per group, or the
    :class:`Malformed` that drops it (the whole group: its advantages are
    relative to every member), in the order given.

    ``max_len``: longest sequence (tokens) the trainer takes (0: no limit);
    ``vocab_size``: token ids must be below it (0: unchecked);
    ``allow_missing_logprobs``: trained tokens without a rollout log-prob get
    NaN instead of dropping the group (the loss must then take the trainer's
    own log-prob there).

    A group is dropped for the first check it fails, in this order: shapes
    and scores, lengths, token ids, trained tokens, log-probs, advantages.
    The per-token checks and the log-prob conversion run once over every
    sequence of the batch (numpy over the concatenated sequences): a batch
    costs a fixed number of array operations plus one small Python step per
    sequence (its sample's lists), whatever the sequences' lengths.
    """
    results: list[ConvertedGroup | Malformed | None] = [None] * len(groups)
    checked: list[_Checked] = []
    for k, g in enumerate(groups):
        try:
            checked.append(_check_structure(g, k, max_len))
        except Malformed as e:
            results[k] = e
    if checked:
        _convert_checked(checked, results, scale_rewards, filter_constant_groups, vocab_size, allow_missing_logprobs)
    return results  # type: ignore[return-value]


def _convert_checked(checked: list[_Checked], results: list, scale_rewards: bool, filter_constant_groups: bool,
                     vocab_size: int, allow_missing_logprobs: bool) -> None:
    seqs = [t for c in checked for t in c.tokens]
    num_seqs = np.fromiter((len(c.tokens) for c in checked), dtype=np.int64, count=len(checked))
    seq_group = np.repeat(np.arange(len(checked)), num_seqs)  # the group (index into checked) of each sequence
    first_seq = np.cumsum(num_seqs) - num_seqs  # each group's first sequence
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    ends = np.cumsum(lens)
    starts = ends - lens
    pos_group = np.repeat(seq_group, lens)  # the group of each token position
    alive = np.ones(len(checked), dtype=bool)

    def drop(bad: np.ndarray, owner: np.ndarray, error) -> None:
        """Groups with a True in ``bad`` (over positions or sequences, ``owner``
        their groups) are dropped with ``error(group, flat index)`` of their first."""
        bad = bad & alive[owner]
        if not bad.any():
            return
        where = np.flatnonzero(bad)
        owners, first = np.unique(owner[where], return_index=True)
        for gi, k in zip(owners.tolist(), where[first].tolist()):
            results[checked[gi].index] = error(gi, k)
            alive[gi] = False

    def seq_pos(gi: int, k: int) -> tuple[int, int]:
        """(sequence within its group, token within its sequence) of flat position k."""
        seq = int(np.searchsorted(ends, k, side="right"))
        return seq - int(first_seq[gi]), k - int(starts[seq])

    # Token ids: plain ints in [0, vocab_size).
    flat_tokens = list(chain.from_iterable(seqs))
    ids = _flat_ints(flat_tokens)
    if ids is not None:
        bad = (ids < 0) | (ids >= vocab_size) if vocab_size else ids < 0
    else:
        bad = np.fromiter((not (_is_int(t) and 0 <= t and (not vocab_size or t < vocab_size)) for t in flat_tokens),
                          dtype=bool, count=len(flat_tokens))
    size = f" (size {vocab_size})" if vocab_size else ""
    drop(bad, pos_group, lambda gi, k: Malformed(
        "bad_value", f"sequence {seq_pos(gi, k)[0]}: token id {flat_tokens[k]!r} is outside the vocabulary{size}"))

    # Trained positions: mask != -100, never a sequence's first token (no logit precedes it).
    flat_masks = list(chain.from_iterable(m for c in checked for m in c.masks))
    mask_ids = _flat_ints(flat_masks)
    if mask_ids is not None:
        trained = mask_ids != MASKED
    else:
        trained = np.fromiter((v != MASKED for v in flat_masks), dtype=bool, count=len(flat_masks))
    trained[starts] = False
    where = np.flatnonzero(trained)
    seq_of = np.searchsorted(ends, where, side="right")
    counts = np.bincount(seq_of, minlength=len(seqs))
    drop(counts == 0, seq_group, lambda gi, i: Malformed(
        "all_masked", f"sequence {i - int(first_seq[gi])} has no trained token (every mask after the first is -100)"))

    # Rollout log-probs at trained positions (0.0 elsewhere); a group without
    # inference_logprobs reads as placeholders everywhere.
    flat_lp = list(chain.from_iterable(
        lp for c in checked for lp in (c.logprobs or ([LOGPROB_PLACEHOLDER] * len(t) for t in c.tokens))))
    lp = None
    if set(map(type, flat_lp)) <= {int, float}:
        try:
            lp = np.fromiter(flat_lp, dtype=np.float64, count=len(flat_lp))
            numeric = np.ones(len(flat_lp), dtype=bool)
        except OverflowError:
            lp = None
    if lp is None:
        numeric = np.fromiter(map(_is_num, flat_lp), dtype=bool, count=len(flat_lp))
        lp = np.fromiter(map(_as_float, flat_lp), dtype=np.float64, count=len(flat_lp))
    placeholder = numeric & (lp == LOGPROB_PLACEHOLDER)
    out_of_range = numeric & ~placeholder & ~(np.isfinite(lp) & (lp <= 1e-3))  # engines round: a hair above 0 is 0
    problem = trained & (~numeric | out_of_range)
    if not allow_missing_logprobs:
        problem |= trained & placeholder

    def lp_error(gi: int, k: int) -> Malformed:
        i, j = seq_pos(gi, k)
        if placeholder[k]:
            what = ("sends no 'inference_logprobs'" if checked[gi].logprobs is None
                    else f"has the placeholder 1.0 at trained token {j}")
            return Malformed("no_logprobs", f"sequence {i} {what}: no rollout log-prob for the off-policy correction")
        if not numeric[k]:
            return Malformed("bad_value", f"sequence {i}: inference log-prob at token {j} is {flat_lp[k]!r}")
        return Malformed("bad_value", f"sequence {i}: inference log-prob {flat_lp[k]!r} at token {j}")

    drop(problem, pos_group, lp_error)
    missing = trained & placeholder
    rollout = np.where(trained, np.minimum(lp, 0.0), 0.0)
    rollout[missing] = math.nan
    missing_per_group = np.bincount(pos_group, weights=missing, minlength=len(checked))

    # Each sequence's trained span [first, end), and its trained positions' slice of ``where``.
    lo = np.searchsorted(seq_of, np.arange(len(seqs)), side="left")
    hi = lo + counts
    if where.size:
        first = where[np.minimum(lo, where.size - 1)] - starts
        end = where[np.maximum(hi - 1, 0)] - starts + 1
    else:
        first = end = np.zeros(len(seqs), dtype=np.int64)

    # Group-relative advantages, one call per group size.
    live = np.flatnonzero(alive).tolist()
    group_adv: dict[int, list[float]] = {}
    constant: dict[int, bool] = {}
    by_size: dict[int, list[int]] = {}
    for gi in live:
        by_size.setdefault(len(checked[gi].scores), []).append(gi)
    for members in by_size.values():
        rewards = torch.tensor([[float(s) for s in checked[gi].scores] for gi in members], dtype=torch.float32)
        adv = group_advantages(rewards, scale_by_std=scale_rewards).tolist()
        const = constant_group_mask(rewards).tolist()
        for row, gi in enumerate(members):
            group_adv[gi], constant[gi] = adv[row], const[row]

    rollout_list = rollout.tolist()
    mask_list = trained.astype(np.float64).tolist()
    firsts, span_ends, offsets, n_trained = first.tolist(), end.tolist(), starts.tolist(), counts.tolist()
    for gi in live:
        c = checked[gi]
        s0 = int(first_seq[gi])
        out = ConvertedGroup([], [float(s) for s in c.scores], constant[gi], sum(n_trained[s0:s0 + len(c.tokens)]),
                             sum(len(t) for t in c.tokens), 0, missing_logprob_tokens=int(missing_per_group[gi]))
        gp = c.generation_params
        if isinstance(gp, dict) and _is_num(gp.get("temperature")):
            out.temperatures.add(float(gp["temperature"]))
        samples = []
        try:
            for i, toks in enumerate(c.tokens):
                q = s0 + i
                f, e, o = firsts[q], span_ends[q], offsets[q]
                ov = c.overrides[i] if i < len(c.overrides) and isinstance(c.overrides[i], dict) else {}
                if c.advantages is not None:
                    a = c.advantages[i]
                    vals = [a[0]] if len(a) == 1 else [a[j - o] for j in where[lo[q]:hi[q]].tolist()]
                    if not all(_is_num(v) and math.isfinite(v) for v in vals):
                        raise Malformed("bad_value", f"sequence {i}: non-finite or non-numeric advantage")
                    adv = sum(vals) / len(vals)
                    if max(vals) - min(vals) > 1e-6:
                        out.averaged_advantages += 1
                else:
                    adv = group_adv[gi][i]
                if ov.get("set_advantage_to_zero"):
                    adv = 0.0
                if _is_num(ov.get("temperature")):
                    out.temperatures.add(float(ov["temperature"]))
                finish = ov.get("finish_reason") or c.group_overrides.get("finish_reason") or "stop"
                finish = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
                out.truncated += finish == "length"
                versions = ov.get("weight_versions", c.group_overrides.get("weight_versions")) or []
                versions = [str(v) for v in versions] if isinstance(versions, list) else [str(versions)]
                loss_mask = None if n_trained[q] == e - f else mask_list[o + f:o + e]
                samples.append(Sample(toks[:f], toks[f:e], rollout_list[o + f:o + e], float(adv), float(c.scores[i]),
                                      finish, versions, loss_mask))
        except Malformed as err:
            results[c.index] = err
            continue
        if not (filter_constant_groups and out.constant and c.advantages is None):
            out.samples = samples
        results[c.index] = out


def convert_group(group: dict, *, scale_rewards: bool = True, filter_constant_groups: bool = False,
                  max_len: int = 0, vocab_size: int = 0, allow_missing_logprobs: bool = False) -> ConvertedGroup:
    """One Atropos ``ScoredData`` group as trainer samples (:func:`convert_groups`
    of one group); raises :class:`Malformed` for a group that cannot be trained."""
    (out,) = convert_groups([group], scale_rewards=scale_rewards, filter_constant_groups=filter_constant_groups,
                            max_len=max_len, vocab_size=vocab_size, allow_missing_logprobs=allow_missing_logprobs)
    if isinstance(out, Malformed):
        raise out
    return out
