"""Generation and weight loading for the built-in inference server.

Protocol-free on purpose: the SGLang routes (``sglang_*.py``) and the vLLM
routes (``vllm_*.py``) translate their JSON into :class:`SamplingParams` and
:meth:`Engine.submit` calls, and their weight-update bodies into receives
(``server/engine/weights.py``) + :meth:`Engine.load_weights`.

Execution model. One worker thread owns the model and the batch: every
forward pass runs there, never on the HTTP event loop. The batch is
continuous: sequences join at step boundaries (their prompts are prefilled
together and joined to the running batch) and leave as soon as they finish.
Samples of one request share one prefill. The engine decides what runs and
keeps the books; how the KV cache is laid out and the model run on it is the
batch's business (``server/engine/batch.py``: an HF ``DynamicCache``, or on a GPU
``server/engine/static_batch.py``'s preallocated slots with CUDA-graph decode, or
``server/engine/paged_batch.py``'s block pool, which also says what to admit and what to
retract when blocks run out), and picking
tokens is ``server/engine/sampling.py``'s.
Everyone else talks to the worker through a condition variable:
``submit`` queues sequences, ``pause``/``abort_all`` run small actions on the
worker between steps, and :meth:`Engine.exclusive` waits until no forward
pass can run (batch empty, or generation paused) so weights can be swapped.

Logprobs. The logprob reported for a sampled token is
``log_softmax(logits / temperature)`` of the model's own logits (plain
``log_softmax(logits)`` when greedy), taken before penalties, logit bias and
top-k / top-p / min-p truncation. That is the quantity a trainer recomputes
from its own forward pass, so importance ratios compare like with like; it is
also what SGLang reports (temperature-scaled, untruncated).
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
import uuid
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from torchtitan_grpo.server.engine.admission import AdmissionWindow
from torchtitan_grpo.server.engine.batch import KVBatch, make_batch, upload
from torchtitan_grpo.server.engine.config import EngineConfig  # noqa: F401  (imported from here too)
from torchtitan_grpo.server.engine.engine_weights import EngineWeights
from torchtitan_grpo.server.engine.expert_views import expert_views
from torchtitan_grpo.server.engine.paged_batch import PagedBatch
from torchtitan_grpo.server.engine.static_batch import StaticBatch
from torchtitan_grpo.server.engine.loading import eos_token_ids, load_model
from torchtitan_grpo.server.engine.requests import DEFAULT_WEIGHT_VERSION, PAUSE_MODES, FinishReason, RequestError, SamplingParams, _Request, _sample_generator, _Sequence, check_prompt, check_prompt_text, decode_each, decode_ids, decode_texts, sample_result
from torchtitan_grpo.server.engine.sampling import Launched, launch_sample

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- #
# Engine
# --------------------------------------------------------------------------- #


def device_broken(e: BaseException) -> bool:
    """Whether ``e`` says the device itself failed (a CUDA error, a device-side assert): the
    context is then unusable and every later step would fail too, unlike a bad request's error."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)


class Engine(EngineWeights):
    """An HF causal LM with continuous batching, pause/resume and hot weight swaps."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.tokenizer = load_model(cfg.model_path, cfg.dtype, cfg.device)
        hf = self.model.config
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context: int = int(getattr(hf, "max_position_embeddings", None) or 1 << 30)
        self.eos_token_ids: tuple[int, ...] = eos_token_ids(self.model, self.tokenizer)
        self.pad_token_id: int = int(getattr(hf, "pad_token_id", None) or 0)
        # Weights are addressed by their HF names (state_dict keys, tied aliases included).
        self._tensors: dict[str, torch.Tensor] = {  # MoE: per-expert names too (server/engine/expert_views.py)
            **self.model.state_dict(keep_vars=True), **expert_views(self.model)}
        self._batch: KVBatch = make_batch(self.model, cfg, self.device, self.pad_token_id)
        self.static_cache = isinstance(self._batch, StaticBatch)  # PagedBatch too: graphs read the parameters
        self.paged = isinstance(self._batch, PagedBatch)
        self.retractions = 0
        """Sequences retracted for KV blocks so far (paged cache)."""
        if self.static_cache:  # the cache holds max_len positions per slot: that is the context now
            self.max_context = min(self.max_context, self._batch.max_len)
            with torch.no_grad():
                self._batch.prepare()  # logs its layout, captures its decode graphs
        self._token_texts: dict[int, str] = {}  # token_texts' cache: at most the vocabulary
        self._rng = random.Random(cfg.seed)  # unseeded samples' draws
        torch.manual_seed(cfg.seed)

        self._weight_version = DEFAULT_WEIGHT_VERSION
        self._cv = threading.Condition()
        self._param_lock = threading.Lock()  # copy-in vs read-out of parameters
        self._pending: deque[_Sequence] = deque()
        self._admission = AdmissionWindow(cfg.admission_window_ms)
        self._actions: list[tuple[Any, concurrent.futures.Future]] = []
        self._finishing: list[_Request] | None = None
        """While :meth:`_record` runs: the requests whose last sample ended, resolved after it."""
        # [len(batch.rows)] the token each row sampled last, not yet in the KV
        # cache (fed by the next decode step); None while the batch is empty.
        self._last: torch.Tensor | None = None
        # The decode step whose tokens are on the device but not yet recorded
        # on the host (overlapped schedule): its rows and its sampling.
        self._inflight: tuple[list[_Sequence], Launched] | None = None
        self._overlap = cfg.overlap_schedule if cfg.overlap_schedule is not None else self.device.type == "cuda"
        self._paused: str | None = None
        self._stepping = False
        self._updating = False
        self._updates_waiting = 0
        self._stopping = False
        self._worker: threading.Thread | None = None
        self.worker_error: BaseException | None = None
        """Set when the device failed under the worker (:func:`device_broken`): the worker has ended."""
        self.on_fatal: Callable[[BaseException], None] | None = None
        """Called from the worker when it ends on a device failure (the server exits on it, so a
        supervisor restarts it: a CUDA context after a device-side assert computes nothing more)."""
        self._debug_sleep: Callable[[float], None] = time.sleep
        """How ``debug_decode_delay_s`` waits (a test swaps it to count steps)."""

    # ---- lifecycle ------------------------------------------------------- #

    def start(self) -> None:
        self._worker = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._worker.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive() and self.worker_error is None

    # ---- public generation API ------------------------------------------ #

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None,
               top_logprobs_num: int = 0, on_token: Callable[[_Sequence], None] | None = None,
               ) -> concurrent.futures.Future:
        """Queue one prompt; the future resolves to ``params.n`` ``SampleResult``s.
        While generation is paused the request waits in the queue. ``on_token``:
        see ``_Request.on_token`` (streaming routes)."""
        self.check_request(prompt_ids, params)
        prompt = [int(t) for t in prompt_ids]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = _Request(rid or uuid.uuid4().hex, prompt, params, int(top_logprobs_num), fut, on_token=on_token)
        req.seqs = [_Sequence(req, j, _sample_generator(params.seed, j)) for j in range(params.n)]
        req.remaining = params.n
        with self._cv:
            if self._stopping:
                raise RequestError("the engine is shutting down")
            if self.worker_error is not None:
                raise RequestError(f"the device failed, the server is exiting: {self.worker_error}")
            self._admission.note(not self._pending)
            for s in req.seqs:
                if params.max_new_tokens == 0:
                    self._finish(s, FinishReason("length", length=0))
                else:
                    self._pending.append(s)
            self._cv.notify_all()
        return fut

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`RequestError` if :meth:`submit` would refuse this request
        (lets a route validate a whole batch before queueing any of it)."""
        check_prompt(prompt_ids, params, self.max_context, self.vocab_size, self.tokenizer is not None)
        why = self._batch.refusal(len(prompt_ids), params.max_new_tokens) if self.paged else None
        if why is not None:
            raise RequestError(why)

    def check_prompt_text(self, text: str, field: str = "text") -> None:
        """Raise :class:`RequestError` naming ``field`` if ``text`` is too long
        to be a prompt of this model; call it before tokenising ``text``."""
        check_prompt_text(text, field, self.max_context)

    def pause(self, mode: str = "abort") -> int:
        """Stop generating between two steps; return how many requests are kept
        waiting. ``abort`` ends live requests (finish reason abort); ``retract``
        drops their KV cache and recomputes it on resume (with the weights of
        that time); ``in_place`` keeps the cache as it is. Requests submitted
        while paused wait."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        return self._run_on_worker(lambda: self._apply_pause(mode))

    def resume(self) -> None:
        with self._cv:
            self._paused = None
            self._cv.notify_all()

    @property
    def paused(self) -> str | None:
        return self._paused

    def abort_all(self, message: str = "aborted") -> int:
        """End every live request now (finish reason abort); return how many."""
        return self._run_on_worker(lambda: self._abort_everything(message))

    def abort(self, rid: str, message: str = "aborted", wait: bool = True) -> int | None:
        """End the live request ``rid`` (all its samples) with finish reason abort.

        ``wait=False`` only queues the abort (for callers on an event loop).
        """
        fn = lambda: self._abort_matching(lambda s: s.req.rid == rid, message)  # noqa: E731
        return self._run_on_worker(fn) if wait else self._post_to_worker(fn)

    def num_live_requests(self) -> int:
        with self._cv:
            return len({id(s.req) for s in list(self._pending) + self._rows})

    def load(self) -> dict[str, int]:
        """Queue and batch occupancy (what a router balances on). Rows that ended are left out:
        they stay in the batch until the step is recorded, after their requests were answered."""
        with self._cv:
            rows = [s for s in self._rows if s.finish is None]
            return {
                "num_reqs": len({id(s.req) for s in rows}),
                "num_waiting_reqs": len({id(s.req) for s in self._pending if not s.output_ids}),
                "num_running_seqs": len(rows),
                "num_tokens": sum(len(s.req.prompt_ids) + len(s.output_ids) for s in rows),
                "num_output_tokens": sum(len(s.output_ids) for s in [*self._pending, *rows]),
            }

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off generation: no new sequence is admitted, running ones finish
        (or stay parked if generation is paused), then the body runs while no
        forward pass can start."""
        with self._cv:
            self._updates_waiting += 1
            self._cv.notify_all()
            try:
                self._cv.wait_for(
                    lambda: not self._stepping
                    and not self._updating
                    and (self._paused is not None or not self._rows)
                    or self._stopping
                )
            finally:
                self._updates_waiting -= 1
            self._updating = True
        try:
            yield
        finally:
            with self._cv:
                self._updating = False
                self._cv.notify_all()

    # ---- worker-side helpers (called with self._cv held) ----------------- #

    def _post_to_worker(self, fn: Any) -> None:
        """Queue ``fn`` for the worker without waiting for it."""
        with self._cv:
            self._actions.append((fn, concurrent.futures.Future()))
            self._cv.notify_all()

    def _run_on_worker(self, fn: Any) -> Any:
        """Run ``fn`` on the worker thread between two steps and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self.alive:
                # No worker (not started or dead): nothing runs concurrently.
                return fn()
            self._actions.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    def _set_version_locked(self, version: str) -> None:
        old = self._weight_version
        if version == old:
            return
        ahead = {id(s) for s in self._inflight[0]} if self._inflight else set()
        for s in self._live_sequences():
            n = len(s.output_ids) + (id(s) in ahead)  # the step in flight ran on ``old`` too
            if n:
                s.version_events.append((old, n))
        self._weight_version = version

    def _live_sequences(self) -> list[_Sequence]:
        return list(self._pending) + list(self._rows)

    def _apply_pause(self, mode: str) -> int:
        if mode == "abort":
            self._abort_everything("generation paused (mode=abort)")
        elif mode == "retract":
            # Drop the KV cache; each sequence re-enters the queue (front, in
            # order) and is re-prefilled from prompt + output on resume.
            self._pending.extendleft(reversed(self._rows))
            self._clear_batch()
        self._paused = mode
        return len({id(s.req) for s in self._live_sequences()})

    def _abort_everything(self, message: str) -> int:
        live = self._live_sequences()
        for s in live:
            self._finish(s, FinishReason("abort", message=message))
        self._pending.clear()
        self._clear_batch()
        return len({id(s.req) for s in live})

    def _abort_matching(self, match: Any, message: str) -> int:
        hit = [s for s in self._live_sequences() if match(s)]
        for s in hit:
            self._finish(s, FinishReason("abort", message=message))
        self._pending = deque(s for s in self._pending if s.finish is None)
        self._prune()
        return len({id(s.req) for s in hit})

    @property
    def _rows(self) -> list[_Sequence]:
        """The running sequences, in the batch's row order (``_last``'s too)."""
        return self._batch.rows

    def _clear_batch(self) -> None:
        self._batch.clear()
        self._last = None
        self._inflight = None

    def _finish(self, s: _Sequence, reason: FinishReason) -> None:
        if s.finish is not None:
            return
        s.finish = reason
        s.end_version = self._weight_version
        req = s.req
        req.remaining -= 1
        if req.remaining == 0 and not req.future.done():
            if self._finishing is not None:
                self._finishing.append(req)
            else:
                self._resolve([req])

    def _resolve(self, reqs: list[_Request]) -> None:
        """Each request's results, their texts decoded together (:func:`decode_texts`)."""
        try:
            texts = iter(decode_texts(self.tokenizer, [x for r in reqs for x in r.seqs]))
        except Exception as e:  # never let bookkeeping kill the worker
            for r in reqs:
                r.future.set_exception(e)
            return
        for r in reqs:
            try:
                r.future.set_result([sample_result(x, self._weight_version, next(texts)) for x in r.seqs])
            except Exception as e:
                r.future.set_exception(e)

    def token_text(self, token_id: int) -> str | None:
        """One token's text (special tokens spelled out); None without a tokenizer."""
        return self.token_texts([token_id])[0]

    def token_texts(self, token_ids: Sequence[int]) -> list[str | None]:
        """:meth:`token_text` of each id. A token's text never changes (weight
        updates keep the tokenizer), so each id is decoded once per server
        and the ids not seen before in one batch: a logprobs reply names
        every output token and its top alternatives, and a decode per name
        cost more than the rest of building the reply."""
        if self.tokenizer is None:
            return [None] * len(token_ids)
        cache = self._token_texts
        missing = list(dict.fromkeys(t for t in token_ids if t not in cache))
        if missing:
            cache.update(zip(missing, decode_each(self.tokenizer, missing)))
        return [cache[t] for t in token_ids]

    # ---- worker loop ----------------------------------------------------- #

    def _ready_to_step(self) -> list[_Sequence] | None:
        """Sequences to admit now ([] = decode only), or None if idle."""
        if self._paused is not None or self._updating:
            return None
        admit: list[_Sequence] = []
        if not self._updates_waiting and (self._batch.can_merge or not self._rows):
            room = self._batch.admissible(self._pending) if self.paged else self._batch.room()
            while self._pending and len(admit) < room:
                admit.append(self._pending.popleft())
        if not admit and not self._rows:
            return None
        return admit

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while True:
                    if self._inflight is not None and (self._actions or self._stopping):
                        self._flush()  # actions see every sampled token recorded
                    while self._actions:
                        fn, fut = self._actions.pop(0)
                        try:
                            fut.set_result(fn())
                        except BaseException as e:
                            fut.set_exception(e)
                        self._cv.notify_all()
                    if self._stopping:
                        self._abort_everything("server shutting down")
                        return
                    hold = self._admission.hold() if self._pending and not self._rows else 0.0
                    if hold > 0:  # idle: the rest of a burst is still being queued
                        self._cv.wait(hold)
                        continue
                    admit = self._ready_to_step()
                    if admit is not None:
                        break
                    self._cv.wait()
                self._stepping = True
            try:
                if admit:
                    self._prefill(admit)
                else:
                    self._decode_step()
            except Exception as e:
                logger.exception("generation step failed; failing the affected requests")
                fatal = device_broken(e)
                with self._cv:
                    for s in set(self._rows) | set(admit):
                        if s.finish is None:
                            self._finish(s, FinishReason("abort", message=f"internal error: {e}"))
                    if fatal:
                        self.worker_error = e
                        self._abort_everything(f"the device failed: {e}")
                    else:
                        self._clear_batch()
                if fatal:  # (the finally below still runs)
                    if self.on_fatal is not None:
                        self.on_fatal(e)
                    return
            finally:
                with self._cv:
                    self._stepping = False
                    self._cv.notify_all()

    # ---- steps (worker thread only) -------------------------------------- #

    def _prefill(self, seqs: list[_Sequence]) -> None:
        self._flush()  # the rows already running have their tokens recorded
        logits = self._batch.prefill(seqs)  # seqs are now the batch's last rows
        launched = self._launch(logits, seqs)
        self._last = launched.tokens if self._last is None else torch.cat([self._last, launched.tokens])
        self._record(seqs, launched)
        self._prune()

    def _decode_step(self) -> None:
        if self.paged and self._batch.rows_to_retract():
            self._retract()
            if not self._rows:
                return
        rows = list(self._rows)
        logits = self._batch.decode(self._last)
        self._debug_decode_delay()
        launched = self._launch(logits, rows)
        self._last = launched.tokens
        # Overlapped: record the step before this one while the device runs
        # this one; rows that ended there are pruned (this step's token for
        # them is dropped). Else, or when the next step could not be
        # launched ahead, record this one now.
        previous, self._inflight = self._inflight, (rows, launched)
        if previous is not None:
            self._record(*previous)
            self._prune()
        if not (self._overlap and self._may_run_ahead()):
            self._flush()

    def _retract(self) -> None:
        """Paged cache out of blocks: record the step in flight, then the
        newest rows give their blocks back and go to the front of the queue
        (oldest first), to be re-prefilled from prompt + output (SGLang's
        retract); their tokens, logprobs and versions stay on them."""
        self._flush()
        n = self._batch.rows_to_retract()
        if not n:
            return
        with self._cv:
            back = self._rows[-n:]
            if n == len(self._rows):
                self._clear_batch()
            else:
                self._batch.keep(list(range(len(self._rows) - n)))
                self._last = self._last[: len(self._rows)]
            self._pending.extendleft(reversed(back))
            self.retractions += n

    def _may_run_ahead(self) -> bool:
        """Whether the next step may be launched before the one in flight is
        recorded: not if a row's next sampling needs its tokens on the host
        (penalties, min_new_tokens still pending) or if every row ends with
        the step in flight (nothing to run ahead for)."""
        ending = 0
        for s in self._rows:
            p, n = s.params, len(s.output_ids) + 1
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or n <= p.min_new_tokens:
                return False
            ending += n >= p.max_new_tokens or len(s.req.prompt_ids) + n >= self.max_context
        return ending < len(self._rows)

    def _flush(self) -> None:
        """Record the step in flight (if any) and prune the rows it ended."""
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._record(*previous)
            self._prune()

    def _debug_decode_delay(self) -> None:
        """``debug_decode_delay_s``: a longer decode step (worker, outside the lock)."""
        if self.cfg.debug_decode_delay_s > 0:
            self._debug_sleep(self.cfg.debug_decode_delay_s)

    def _prune(self) -> None:
        """Drop finished sequences from the running batch."""
        with self._cv:
            keep = [i for i, s in enumerate(self._rows) if s.finish is None]
            if len(keep) == len(self._rows):
                return
            if not keep:
                self._clear_batch()
                return
            self._batch.keep(keep)
            self._last = self._last[upload(keep, self.device)]

    # ---- sampling -------------------------------------------------------- #

    def _launch(self, logits: torch.Tensor, seqs: list[_Sequence]) -> Launched:
        return launch_sample(logits, seqs, self.device, self._rng, self.eos_token_ids)

    def _record(self, seqs: list[_Sequence], launched: Launched) -> None:
        """Record each live row's token (and its logprob), check stops."""
        picked = launched.resolve()
        finishing: list[_Request] = []
        try:
            with self._cv:  # set and cleared under the lock, as every _finish runs
                self._finishing = finishing
                try:
                    for i, s in enumerate(seqs):
                        if s.finish is not None:
                            continue
                        s.output_ids.append(picked.token_ids[i])
                        s.logprobs.append(picked.logprobs[i])
                        if i in picked.top:  # appended in place: a copy per token is quadratic in the length
                            if s.top is None:
                                s.top = []
                            s.top.append(picked.top[i])
                        if s.req.on_token is not None:
                            s.req.on_token(s)
                        self._check_stop(s)
                finally:
                    self._finishing = None
        finally:
            if finishing:  # outside the lock: the event loop may queue requests meanwhile
                self._resolve(finishing)

    def _check_stop(self, s: _Sequence) -> None:
        p = s.params
        tok = s.output_ids[-1]
        n_out = len(s.output_ids)
        if n_out >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                self._finish(s, FinishReason("stop", matched=tok))
                return
            if p.stop:
                longest = max(len(x) for x in p.stop)
                tail = decode_ids(self.tokenizer, s.output_ids[-(longest + 8) :], p.skip_special_tokens)
                hit = next((x for x in p.stop if x in tail), None)
                if hit is not None:
                    s.stop_text = hit
                    self._finish(s, FinishReason("stop", matched=hit))
                    return
        if n_out >= p.max_new_tokens:
            self._finish(s, FinishReason("length", length=n_out))
        elif len(s.req.prompt_ids) + n_out >= self.max_context:
            self._finish(s, FinishReason("length", length=n_out))

