"""Wiring of the inference side for grpo_train.py (rank 0 only): servers,
pool, rollout manager, weight pusher and metrics, built from the config and
torn down in reverse order whatever happens."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.engine_commands import VLLM_TRANSFER, EngineLaunch
from torchtitan_grpo.fleet.launcher import ReplicaEvent, ServerSpec, Supervisor, format_events, running_servers
from torchtitan_grpo.fleet.pool import InferencePool, PoolConfig
from torchtitan_grpo.fleet.route_backend import replay_shape
from torchtitan_grpo.fleet.types import SamplingParams
from torchtitan_grpo.metrics import MetricLogger, window_mean
from torchtitan_grpo.config.job_config import api_key, client_process, pipeline_depth, server_devices, servers_share_trainer_gpu
from torchtitan_grpo.models.gguf import is_gguf_path, resolve_model_dir
from torchtitan_grpo.rollout.client_process import RolloutProcess, SpawnedClient
from torchtitan_grpo.rollout.evaluation import EvalResult, Evaluator, format_eval_line
from torchtitan_grpo.rollout.producer import ProducerSpec, RolloutProducer, build_producer
from torchtitan_grpo.train.trainer import Dist
from torchtitan_grpo.weight_sync import adapter_push
from torchtitan_grpo.weight_sync.gather import push_dtype
from torchtitan_grpo.weight_sync.pusher import NoPush, Pusher, PushConfig, WeightPusher

if TYPE_CHECKING:
    from torchtitan_grpo.train.checkpoint import Resumed
    from torchtitan_grpo.config.eval import Eval
    from torchtitan_grpo.rollout.atropos import AtroposSource

logger = logging.getLogger("torchtitan_grpo")


def prepare_model_dir(cfg, d: Dist) -> str:
    """The HF checkpoint directory; with grpo.tiny_model_if_missing, rank 0
    writes the tiny demo model first and the others wait for it. A .gguf
    file: rank 0 dequantises it into the dump folder (reused on resume)."""
    path = cfg.model.hf_assets_path
    if is_gguf_path(path):
        path = resolve_model_dir(path, cfg.job.dump_folder, convert=d.is_main)
    elif cfg.grpo.tiny_model_if_missing and not os.path.isfile(os.path.join(path, "config.json")):
        if d.is_main:
            from torchtitan_grpo.models.demo_assets import DEMO_MOE_MODEL_DIR, TinyQwen3, ensure_tiny_qwen3

            moe = os.path.normpath(path) == os.path.normpath(DEMO_MOE_MODEL_DIR)
            logger.info("writing a tiny random Qwen3%s model and tokenizer to %s", "-MoE" if moe else "", path)
            ensure_tiny_qwen3(path, TinyQwen3(seed=cfg.grpo.seed))
    if d.world_size > 1:
        dist.barrier()
    return path


@dataclass
class RolloutSide:
    rollouts: RolloutProducer | RolloutProcess | AtroposSource
    """Finished groups for the trainer (the producer in rank 0's process, or
    in a client process beside it); its state_dict() (the prompts handed to
    the trainer) is checkpointed."""
    pusher: WeightPusher
    log: MetricLogger
    pad_id: int
    supervisor: Supervisor | None = None
    """Watches the servers the trainer started (None for external ones)."""
    evaluator: Evaluator | None = None
    """``[eval]``: held-out prompts on the same servers (None: no evaluation)."""
    eval_config: Eval | None = None
    eval_blocking: bool = False
    """Serial loop: the trainer waits for each evaluation (exact weights)."""
    eval_results: list[EvalResult] = field(default_factory=list)

    def evaluate(self, step: int, version: int, point: str = "step") -> None:
        """Evaluate the weights of ``step`` where ``[eval]`` says so (``point``:
        "start" before the first step, "step" after one, "end" once the
        servers hold the final weights), and log every evaluation that has
        finished. "end" waits for all of them."""
        ev = self.evaluator
        if ev is None:
            return
        cfg = self.eval_config
        due = {"start": cfg.at_start, "end": cfg.at_end,
               "step": cfg.interval > 0 and step % cfg.interval == 0}[point]
        if due:
            ev.submit(step, version)
        for result in ev.wait() if self.eval_blocking or point == "end" else ev.poll():
            logger.info(format_eval_line(result.step, result.metrics))
            self.log.log_eval(result.step, result.metrics)
            self.eval_results.append(result)

    def summary(self) -> dict:
        # The run's steps, those before a resume included (read back from metrics.jsonl):
        # "first 10 steps" must mean where the run started, not where this process did.
        h = self.log.earlier + self.log.history
        first, last = window_mean(h, "reward/mean", True), window_mean(h, "reward/mean", False)
        n = min(10, len(h))
        resumed = (f" (run resumed at step {self.log.resume_step}; earlier steps read from metrics.jsonl)"
                   if self.log.earlier else "")
        if n:  # a run stopped before its first step has no reward to report
            logger.info("mean reward: first %d steps %.3f, last %d steps %.3f%s", n, first, n, last, resumed)
        out = {"reward_first10": first, "reward_last10": last, "steps": len(self.log.history)}
        if self.eval_results:
            a, b = self.eval_results[0], self.eval_results[-1]
            logger.info("eval pass@1: step %d %.3f, step %d %.3f", a.step, a.metrics["eval/pass@1"], b.step,
                        b.metrics["eval/pass@1"])
            out |= {"eval": [(r.step, r.metrics) for r in self.eval_results]}
        events = [ReplicaEvent(*e) for e in self.rollouts.pool.events]
        if self.supervisor is not None:
            events += self.supervisor.events
            out |= {f"servers_{k}": v for k, v in self.supervisor.counts().items()}
        if events:
            logger.warning("inference replica events:\n%s", format_events(causal_order(events)))
        out["replica_events"] = len(events)
        return out


def _replica_events(pool: InferencePool, max_restarts: int):
    """What the pool does when the launcher's watcher sees a server exit, come
    back or be given up (called on the watcher's thread)."""
    def on_event(e: ReplicaEvent) -> None:
        if e.kind == "exited":
            pool.mark_down(e.url, f"process exited ({e.detail})")  # re-send its groups, leave the push
        elif e.kind == "gave_up":
            pool.retire(e.url, gave_up_reason(e.detail, max_restarts))
        # "restarted": the pool's health check sees it; the pusher catches it up and readmits it
    return on_event


def gave_up_reason(detail: str, max_restarts: int) -> str:
    """Why a launched server is gone for good, as its retirement reads in the
    pool (and so in the stop line when it was the last): ``detail`` is the
    launcher's count of attempts."""
    if max_restarts == 0:
        return "exited; inference.server_max_restarts = 0 allows no restart"
    return f"exited; given up {detail}: inference.server_max_restarts = {max_restarts}"


# The launcher's events (its watcher) and the pool's (health checks, pusher) come
# from different threads: a restarted server can pass the pool's health check and be
# caught up before the watcher's own check records "restarted".
_SERVER_OUT = ("exited", "restart_failed")
_SERVING_AGAIN = ("back", "readmitted")


def causal_order(events: list[ReplicaEvent]) -> list[ReplicaEvent]:
    """The events by time, except that a server's "back" / "readmitted"
    recorded between its exit and its "restarted" follow the "restarted"."""
    out: list[ReplicaEvent] = []
    held: dict[str, list[ReplicaEvent]] = {}  # url -> events waiting for its "restarted"
    for e in sorted(events, key=lambda e: e.time):
        if e.kind in _SERVER_OUT:
            held.setdefault(e.url, [])
        elif e.kind in _SERVING_AGAIN and e.url in held:
            held[e.url].append(e)
            continue
        out.append(e)
        if e.kind in ("restarted", "gave_up"):
            out += held.pop(e.url, [])
    return out + [e for waiting in held.values() for e in waiting]


def _atropos_source(cfg, hf_dir: str, pool: InferencePool, resume: Resumed | None):
    """rollout.source = "atropos": scored groups pulled from Atropos's trajectory API."""
    from torchtitan_grpo.models.hf_bridge import load_hf_config
    from torchtitan_grpo.rollout.atropos import AtroposConfig, AtroposSource

    r, c = cfg.rollout, cfg.checkpoint
    source = AtroposSource(
        AtroposConfig(url=r.atropos_url, batch_size=cfg.grpo.prompts_per_step * cfg.grpo.group_size,
                      max_token_len=cfg.training.seq_len, num_steps=cfg.training.steps,
                      checkpoint_dir=os.path.abspath(os.path.join(cfg.job.dump_folder, c.folder)),
                      checkpoint_interval=c.interval if c.enable else -1,
                      wandb_group=os.path.basename(os.path.abspath(cfg.job.dump_folder)),
                      startup_timeout_s=r.atropos_startup_timeout_s,
                      unreachable_timeout_s=r.atropos_unreachable_timeout_s),
        scale_rewards=cfg.grpo.scale_rewards, filter_constant_groups=cfg.grpo.filter_constant_groups,
        temperature=r.temperature, vocab_size=int(load_hf_config(hf_dir).get("vocab_size", 0)),
        starting_step=resume.step if resume is not None else 0, pool=pool)
    if resume is not None and resume.prompts is not None:
        source.load_state_dict(resume.prompts)
    return source


def producer_spec(cfg, hf_dir: str, tok, resume: Resumed | None) -> ProducerSpec:
    """The built-in source's producer, from the config (``tok``: its stop token)."""
    r, g = cfg.rollout, cfg.grpo
    return ProducerSpec(
        hf_dir=hf_dir, task=r.task, dataset_path=r.dataset_path, prompt_key=r.prompt_key, reward_fn=r.reward_fn,
        prompts_per_step=g.prompts_per_step, group_size=g.group_size, seed=g.seed, depth=pipeline_depth(cfg),
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=_stop_ids(tok)),
        scale_rewards=g.scale_rewards, filter_constant_groups=g.filter_constant_groups,
        reward_timeout_s=r.reward_timeout_s, use_chat_template=r.use_chat_template,
        resume_prompts=resume.prompts if resume is not None else None,
        max_sequence_tokens=max_sequence_tokens(cfg),
        overlong_buffer_tokens=g.overlong_buffer_tokens, overlong_penalty_factor=g.overlong_penalty_factor,
        dynamic_sampling=g.dynamic_sampling, dynamic_sampling_max_filtered=g.dynamic_sampling_max_filtered,
        seeded_requests=r.seeded_requests)


def max_sequence_tokens(cfg) -> int:
    """The longest sample the run can use: ``training.seq_len`` (the trainer's
    RoPE table ends there), or ``inference.max_model_len`` when set and
    smaller (the started servers refuse longer requests)."""
    limit = cfg.training.seq_len
    return min(limit, cfg.inference.max_model_len) if cfg.inference.max_model_len > 0 else limit


def push_mode_hint(cfg) -> str | None:
    """A warning when the config picks the slower push for its loop: serial
    with the servers on the trainer's GPU, an async push lands while the next
    step's groups generate and slows them (one GPU, float32 trainer: 1.32 s
    against 1.21 s a step with the sync push, issue 37)."""
    if pipeline_depth(cfg) == 0 and cfg.weight_sync.mode == "async" and servers_share_trainer_gpu(cfg):
        return ("rollouts are serial with the servers on the trainer's GPU: weight_sync.mode \"sync\" is faster "
                "there than \"async\" (an async version lands while the next groups generate)")
    return None


def _stop_ids(tok) -> tuple[int, ...]:
    return (tok.eos_token_id,) if tok.eos_token_id is not None else ()


def _name_adapters_to(pusher, pool) -> None:
    """With the adapter push, ``pool`` names each replica's newest adapter in its requests too."""
    transport = getattr(pusher, "transport", None)
    if not hasattr(transport, "on_adapter"):
        return
    before = transport.on_adapter

    def both(url: str, name: str) -> None:
        before(url, name)
        pool.set_adapter(url, name)

    transport.on_adapter = both


def _evaluator(cfg, tok, loop: LoopThread, pool: InferencePool | None, urls: list[str], pool_config: PoolConfig,
               pusher: WeightPusher, stack: contextlib.ExitStack) -> Evaluator:
    """``[eval]``'s evaluator on rank 0's event loop. ``pool`` None: the
    rollouts' pool lives in the client process, and the evaluation gets one
    of its own here (a few requests every eval.interval steps)."""
    from torchtitan_grpo.rollout.evaluation import eval_rows
    from torchtitan_grpo.rollout.producer import task_scorer

    e, r, w = cfg.eval, cfg.rollout, cfg.weight_sync
    if pool is None:
        pool = InferencePool(urls, pool_config)
        loop.run(pool.start())
        stack.callback(lambda: loop.run(pool.close(), timeout=10))
        _name_adapters_to(pusher, pool)
    scorer = task_scorer(tok, r.task, r.reward_fn, group_size=e.samples_per_prompt, prompt_key=r.prompt_key,
                         scale_rewards=False, reward_timeout_s=r.reward_timeout_s, use_chat_template=r.use_chat_template)
    greedy = e.temperature == 0
    sampling = SamplingParams(max_new_tokens=e.max_new_tokens or r.max_new_tokens, temperature=e.temperature,
                              top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                              stop_token_ids=_stop_ids(tok))
    # A replica that misses its deadline is ejected and no longer waited for:
    # a few deadlines bound the wait for the version to evaluate.
    wait = None if w.mode == "off" else (lambda v: pusher.wait_for(v, timeout_s=4 * w.replica_deadline_s))
    return Evaluator(loop, pool, scorer, eval_rows(e, r), sampling=sampling, pass_threshold=e.pass_threshold,
                     max_concurrent=e.max_concurrent, wait_version=wait, max_sequence_tokens=max_sequence_tokens(cfg))


def server_engine_args(i, seq_len: int = 0) -> tuple[str, ...]:
    """The ``[inference]`` engine settings (``i``) as the started built-in
    servers' command-line flags. Their context is ``max_model_len``, else
    ``seq_len`` (``training.seq_len``: no longer sample can be trained, and
    the engine's own default stops at 2,048 positions)."""
    max_len = i.max_model_len or seq_len
    args = ("--kv-cache", i.kv_cache, "--max-model-len", str(max_len), "--max-batch-size", str(i.max_batch_size))
    if i.kv_cache in ("paged", "auto") and i.kv_cache_memory_gb > 0:
        args += ("--kv-cache-memory-gb", str(i.kv_cache_memory_gb))
    if i.chat_template:  # a file's path made absolute: the servers may start elsewhere
        template = os.path.abspath(i.chat_template) if os.path.isfile(i.chat_template) else i.chat_template
        args += ("--chat-template", template)
    return args


def served_model_name(cfg, hf_dir: str) -> str:
    """The ``model`` of every vLLM request: inference.model, else for a vLLM
    the trainer starts the name it is started under (vLLM answers 404 to a
    request for any other); the built-in server ignores it."""
    i = cfg.inference
    launched = i.backend != "builtin" and not (i.urls or i.replica_file)
    return i.model or (os.path.basename(os.path.normpath(hf_dir)) if launched else "")


def engine_launch(cfg, hf_dir: str) -> EngineLaunch:
    """What a vLLM or SGLang the trainer starts needs of ``[inference]`` and
    ``[weight_sync]`` (the built-in server takes ``server_engine_args``)."""
    i, w = cfg.inference, cfg.weight_sync
    pushing = w.mode != "off" and w.transport in VLLM_TRANSFER
    return EngineLaunch(gpu_memory_utilization=i.gpu_memory_utilization,
                        max_model_len=i.max_model_len or cfg.training.seq_len,
                        served_model_name=served_model_name(cfg, hf_dir),
                        weight_transfer=w.transport if pushing else "", fp64_sampler=i.vllm_fp64_sampler,
                        args=tuple(i.engine_args))


@contextlib.contextmanager
def rollout_side(cfg, hf_dir: str, d: Dist, resume: Resumed | None = None):
    """With ``resume``, the prompt source continues where the checkpoint left
    it, and the servers' on-disk weights are tagged version -1 (not the
    trainer's): the caller pushes the restored weights before any rollout."""
    from transformers import AutoTokenizer

    i, w, r = cfg.inference, cfg.weight_sync, cfg.rollout
    tok = AutoTokenizer.from_pretrained(hf_dir)
    depth = pipeline_depth(cfg)
    # Pipelined, the fleet is always generating: a version is installed between
    # decode steps instead of after a batch that never drains.
    pause_mode = "in_place" if depth > 0 and w.pause_mode == "none" else w.pause_mode
    key = api_key(cfg)
    with contextlib.ExitStack() as stack:
        # The rollout client's process starts first: its imports overlap the servers' start.
        spawned = SpawnedClient.spawn() if client_process(cfg) else None
        if spawned is not None:
            stack.callback(spawned.close)
        supervisor = None
        # Where environments that sample from our servers (Atropos) find them: an
        # earlier run's list would send an environment started now to dead servers.
        replica_list = os.path.join(cfg.job.dump_folder, "servers", "replicas.txt")
        with contextlib.suppress(FileNotFoundError):
            os.remove(replica_list)
        if i.urls or i.replica_file:
            urls = list(i.urls)
        else:
            engine_args = server_engine_args(i, cfg.training.seq_len)
            if cfg.grpo.router_replay == "rollout":  # the servers capture what the trainer replays
                engine_args += ("--enable-return-routed-experts",)
            devices = server_devices(cfg)[1]  # inference.server_devices spread over the servers, or server_device
            launch = engine_launch(cfg, hf_dir)
            specs = [ServerSpec(hf_dir, device=devices[k], dtype=i.server_dtype, host=i.host,
                                threads=i.server_threads, seed=cfg.grpo.seed + k, api_key=key,
                                extra_args=engine_args if i.backend == "builtin" else (),
                                engine=i.backend, launch=launch)
                     for k in range(i.num_servers)]
            servers = stack.enter_context(running_servers(specs, os.path.join(cfg.job.dump_folder, "servers"),
                                                          i.startup_timeout_s, max_restarts=i.server_max_restarts))
            urls = [s.url for s in servers]
            supervisor = servers.supervisor
            with open(replica_list, "w") as f:  # once they are up
                f.write("".join(u + "\n" for u in urls))
        loop = LoopThread()
        stack.callback(loop.close)
        pool_config = PoolConfig(backend=i.backend, model=served_model_name(cfg, hf_dir), replica_file=i.replica_file or None,
                                 request_timeout_s=i.request_timeout_s, max_retries=i.max_retries, api_key=key,
                                 route_shape=replay_shape(cfg.grpo.router_replay, hf_dir))
        client = None
        if spawned is not None:
            # The producer and its pool live in the client process; `pool` is their control surface here.
            client = RolloutProcess(producer_spec(cfg, hf_dir, tok, resume), urls, pool_config,
                                    pushing=w.mode != "off", startup_timeout_s=i.startup_timeout_s,
                                    max_restarts=r.client_max_restarts, spawned=spawned)
            stack.callback(client.close)
            pool = client.pool
        else:
            pool = InferencePool(urls, pool_config)
        adapter_cfg = None  # weight_sync.lora_push = "adapter": only the LoRA adapter travels
        if cfg.lora.enable and w.lora_push == "adapter":
            adapter_cfg = adapter_push.config_from_lora(cfg.lora, hf_dir)
        if w.mode == "off":
            pusher: WeightPusher = NoPush()
        else:
            pusher = Pusher(loop, urls, PushConfig(
                # the LoRA adapter alone, the changed elements (weight_sync.delta), or whole tensors
                mode=w.mode, backend="adapter" if adapter_cfg else "delta" if w.delta else w.transport,
                adapter_config=adapter_cfg,
                fanout=w.fanout, master_address=w.master_address,
                bucket_bytes=w.bucket_size_mb << 20, num_staging_buffers=w.num_staging_buffers,
                deadline_s=w.replica_deadline_s, init_timeout_s=w.init_timeout_s, pause_mode=pause_mode,
                protocol="vllm" if i.backend == "vllm" else "sglang",
                dtype=push_dtype(w), staging=w.staging, pipelined=w.pipeline_requests, ack_posted=w.ack_posted,
                api_key=key,
                disk_folder=w.disk_folder or os.path.join(cfg.job.dump_folder, "pushed_weights")),
                device=d.device, on_eject=pool.eject, on_readmit=pool.readmit)
            stack.callback(pusher.close)
            pool.on_join = pusher.add_replica  # replicas from inference.replica_file get weights too
            pool.on_down = pusher.replica_down  # a replica known to be down leaves the push at once
            if adapter_cfg:  # requests name the adapter a replica serves once it serves it
                _name_adapters_to(pusher, pool)
        if client is not None:
            pool.start()
        else:
            loop.run(pool.start())
            stack.callback(lambda: loop.run(pool.close(), timeout=10))
        if supervisor is not None:
            supervisor.on_event = _replica_events(pool, i.server_max_restarts)
        if w.mode != "off":
            if client is not None:
                pool.pushing()  # replicas that join from now on get the weights before their first group
            pusher.connect(initial_version=0 if resume is None else -1)

        if r.source == "atropos":
            rollouts = _atropos_source(cfg, hf_dir, pool, resume)
        elif client is not None:
            rollouts = client
        else:
            rollouts = build_producer(producer_spec(cfg, hf_dir, tok, resume), loop, pool, tokenizer=tok)
        stack.callback(rollouts.close)
        if r.source == "builtin":
            logger.info("rollouts: %s (pipeline depth %d)%s%s", "pipelined" if depth else "serial", depth,
                        ", client in its own process" if client is not None else "",
                        f"; weight updates pause generation {pause_mode}" if depth and w.mode != "off" else "")
            hint = push_mode_hint(cfg)
            if hint:
                logger.warning(hint)
        log = MetricLogger(cfg.job.dump_folder, cfg.metrics.save_tb_folder, cfg.metrics.enable_tensorboard,
                           resume_step=None if resume is None else resume.step)
        stack.callback(log.close)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        evaluator = None
        if cfg.eval.enable:
            evaluator = _evaluator(cfg, tok, loop, pool if client is None else None, urls, pool_config, pusher, stack)
        yield RolloutSide(rollouts, pusher, log, pad_id, supervisor, evaluator, cfg.eval, eval_blocking=depth == 0)
