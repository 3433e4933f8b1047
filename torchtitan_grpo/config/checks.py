"""Start-up checks of the configuration: every value of our sections (and
the TorchTitan keys we rely on), the model path, external servers, and the
TOML file's keys, each failing with one message that names the key or file.
The sections themselves are in config/job_config.py."""

from __future__ import annotations

import os
import re
import sys

from torchtitan_grpo.config.eval import validate_eval
from torchtitan_grpo.config.lora import validate_lora


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def _check(ok: bool, key: str, msg: str, value) -> None:
    if not ok:
        raise ConfigError(f"config key {key} = {value!r}: {msg}")


def validate(cfg) -> None:
    """Check every value of our sections (and the TorchTitan keys we rely on)."""
    from torchtitan_grpo.config.job_config import _gpu_count, _trainer_gpus, server_devices
    from torchtitan_grpo.train.loss import LOSS_VARIANTS

    g, r, i, w = cfg.grpo, cfg.rollout, cfg.inference, cfg.weight_sync
    _check(g.group_size >= 2, "grpo.group_size", "must be >= 2 (advantages are relative within a group)", g.group_size)
    _check(g.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1", g.prompts_per_step)
    _check(g.micro_batch_size >= 1, "grpo.micro_batch_size", "must be >= 1", g.micro_batch_size)
    _check(0 <= g.clip_low < 1, "grpo.clip_low", "must be in [0, 1)", g.clip_low)
    _check(g.clip_high >= 0, "grpo.clip_high", "must be >= 0", g.clip_high)
    _check(g.loss_agg in LOSS_VARIANTS, "grpo.loss_agg", f"must be one of {', '.join(LOSS_VARIANTS)}", g.loss_agg)
    _check(0 <= g.gspo_clip_low < 1, "grpo.gspo_clip_low", "must be in [0, 1)", g.gspo_clip_low)
    _check(g.gspo_clip_high >= 0, "grpo.gspo_clip_high", "must be >= 0", g.gspo_clip_high)
    _check(0 <= g.cispo_clip_low <= 1, "grpo.cispo_clip_low", "must be in [0, 1] (1: no lower bound)", g.cispo_clip_low)
    _check(g.cispo_clip_high >= 0, "grpo.cispo_clip_high", "must be >= 0", g.cispo_clip_high)
    _check(g.kl_coef >= 0, "grpo.kl_coef", "must be >= 0", g.kl_coef)
    _check(g.max_staleness >= -1, "grpo.max_staleness", "must be -1 (off) or >= 0", g.max_staleness)
    _check(g.is_correction in ("none", "token", "sequence"), "grpo.is_correction",
           'must be "none", "token" or "sequence"', g.is_correction)
    _check(g.is_cap > 0, "grpo.is_cap", "must be > 0", g.is_cap)
    _check(g.logprob_chunk_tokens >= 0, "grpo.logprob_chunk_tokens", "must be >= 0 (0: full logits)",
           g.logprob_chunk_tokens)
    _check(r.source in ("builtin", "atropos"), "rollout.source", 'must be "builtin" or "atropos"', r.source)
    if r.source == "atropos":
        _check(r.atropos_url.startswith(("http://", "https://")), "rollout.atropos_url", "must be an http(s) URL",
               r.atropos_url)
        _check(r.atropos_startup_timeout_s > 0, "rollout.atropos_startup_timeout_s", "must be > 0",
               r.atropos_startup_timeout_s)
        _check(r.atropos_unreachable_timeout_s >= 0, "rollout.atropos_unreachable_timeout_s",
               "must be >= 0 (0: never give up)", r.atropos_unreachable_timeout_s)
    _check(r.task in ("digits", "jsonl"), "rollout.task", 'must be "digits" or "jsonl"', r.task)
    if r.task == "jsonl":
        _check(bool(r.dataset_path), "rollout.dataset_path", 'is required when rollout.task = "jsonl"', r.dataset_path)
        _check(os.path.isfile(r.dataset_path), "rollout.dataset_path", "no such file", r.dataset_path)
        _check(bool(r.reward_fn), "rollout.reward_fn", 'is required when rollout.task = "jsonl"', r.reward_fn)
    if r.reward_fn:
        from torchtitan_grpo.rollout.rewards import BUILTIN_REWARDS, load_reward_fn

        _check(r.reward_fn in BUILTIN_REWARDS or r.reward_fn.count(":") == 1, "rollout.reward_fn",
               f'must look like "package.module:function" or be a built-in name {sorted(BUILTIN_REWARDS)}', r.reward_fn)
        try:  # before any server starts: a typo must not cost a minute of start-up
            load_reward_fn(r.reward_fn)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            _check(False, "rollout.reward_fn", f"cannot be loaded: {e}", r.reward_fn)
    _check(r.reward_timeout_s > 0, "rollout.reward_timeout_s", "must be > 0", r.reward_timeout_s)
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens)
    _check(g.overlong_buffer_tokens >= 0, "grpo.overlong_buffer_tokens", "must be >= 0 (0: off)",
           g.overlong_buffer_tokens)
    _check(g.overlong_penalty_factor >= 0, "grpo.overlong_penalty_factor", "must be >= 0", g.overlong_penalty_factor)
    if g.overlong_buffer_tokens > 0:
        _check(g.overlong_buffer_tokens < r.max_new_tokens, "grpo.overlong_buffer_tokens",
               f"must be < rollout.max_new_tokens ({r.max_new_tokens}): the buffer is the budget's last tokens",
               g.overlong_buffer_tokens)
        _check(r.source == "builtin", "grpo.overlong_buffer_tokens",
               'needs rollout.source = "builtin" (Atropos environments compute their own rewards)',
               g.overlong_buffer_tokens)
    _check(g.dynamic_sampling_max_filtered >= 0, "grpo.dynamic_sampling_max_filtered",
           "must be >= 0 (0: 10 x grpo.prompts_per_step)", g.dynamic_sampling_max_filtered)
    _check(not g.dynamic_sampling or r.source == "builtin", "grpo.dynamic_sampling",
           'needs rollout.source = "builtin" (an Atropos environment decides which groups it sends)',
           g.dynamic_sampling)
    _check(r.temperature > 0, "rollout.temperature", "must be > 0 (GRPO needs sampled, not greedy, completions)", r.temperature)
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p)
    _check(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", "must be -1 (off) or >= 1", r.top_k)
    _check(r.client_process != "on" or r.source == "builtin", "rollout.client_process",
           'can be "on" only with rollout.source = "builtin"', r.client_process)
    _check(r.client_max_restarts >= 0, "rollout.client_max_restarts", "must be >= 0", r.client_max_restarts)
    _check(r.pipeline_depth >= -1, "rollout.pipeline_depth", "must be -1 (auto), 0 (serial) or >= 1", r.pipeline_depth)
    _check(r.pipeline_depth <= 0 or w.mode != "sync", "rollout.pipeline_depth",
           'must be 0 or -1 with weight_sync.mode = "sync" (exactly on-policy); pipelining needs "async" or "off"',
           r.pipeline_depth)
    if i.api_key.startswith("env:"):
        _check(bool(os.environ.get(i.api_key[4:])), "inference.api_key",
               f"environment variable {i.api_key[4:]!r} is not set or empty", i.api_key)
    if i.backend != "builtin" and not (i.urls or i.replica_file):
        _check_launched_engine(cfg)
    for u in i.urls:
        _check(u.startswith(("http://", "https://")), "inference.urls", f"{u!r} is not an http(s) URL", i.urls)
    _check(i.num_servers >= 1, "inference.num_servers", "must be >= 1", i.num_servers)
    _check(i.max_batch_size >= 1, "inference.max_batch_size", "must be >= 1", i.max_batch_size)
    _check(re.fullmatch(r"cpu|cuda(:\d+)?", i.server_device) is not None, "inference.server_device",
           'must be "cpu", "cuda" or "cuda:N"', i.server_device)
    for dev in i.server_devices:
        _check(re.fullmatch(r"cpu|cuda(:\d+)?", dev) is not None or list(i.server_devices) == ["auto"],
               "inference.server_devices", f'{dev!r}: each must be "cpu", "cuda" or "cuda:N" (or the list ["auto"])',
               i.server_devices)
    if not (i.urls or i.replica_file):
        key, devices = server_devices(cfg)
        _check(bool(devices), key, f"this node has {_gpu_count()} GPU(s) and its trainer ranks use cuda:0.."
                                   f"cuda:{_trainer_gpus() - 1}: none is left for the servers", i.server_devices)
    _check(i.max_model_len == 0 or i.max_model_len >= 2, "inference.max_model_len",
           "must be 0 (the model's context, at most 2048) or >= 2", i.max_model_len)
    if i.chat_template:
        from torchtitan_grpo.models.chat_template import load_chat_template

        try:
            load_chat_template(i.chat_template)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            _check(False, "inference.chat_template", f"is neither a readable file nor a Jinja template ({e})",
                   i.chat_template[:80])
    _check(i.startup_timeout_s > 0, "inference.startup_timeout_s", "must be > 0", i.startup_timeout_s)
    _check(i.server_max_restarts >= 0, "inference.server_max_restarts", "must be >= 0", i.server_max_restarts)
    _check(i.request_timeout_s > 0, "inference.request_timeout_s", "must be > 0", i.request_timeout_s)
    _check(i.max_retries >= 1, "inference.max_retries", "must be >= 1", i.max_retries)
    _check(w.bucket_size_mb >= 1, "weight_sync.bucket_size_mb", "must be >= 1", w.bucket_size_mb)
    _check(w.init_timeout_s > 0, "weight_sync.init_timeout_s", "must be > 0", w.init_timeout_s)
    _check(w.transport != "disk" or i.backend != "vllm", "weight_sync.transport",
           "disk needs the SGLang protocol (/update_weights_from_disk); vLLM has no such route", w.transport)
    _check(w.transport != "ipc" or w.staging == "device", "weight_sync.staging",
           'must be "device" with weight_sync.transport = "ipc" (replicas map the staging buffers: '
           'SGLang\'s /update_weights_from_tensor, vLLM\'s IPC engine)', w.staging)
    _check(w.staging in ("device", "host"), "weight_sync.staging", 'must be "device" or "host"', w.staging)
    _check(w.num_staging_buffers >= 1, "weight_sync.num_staging_buffers", "must be >= 1", w.num_staging_buffers)
    _check(i.kv_cache_memory_gb >= 0, "inference.kv_cache_memory_gb", "must be >= 0 (0: the server's default)",
           i.kv_cache_memory_gb)
    fanout = getattr(w, "fanout", "per_replica")
    _check(fanout == "per_replica" or (w.transport in ("gloo", "nccl") and i.backend != "vllm"), "weight_sync.fanout",
           '"broadcast" needs a weight group (weight_sync.transport "gloo" or "nccl") and the SGLang protocol '
           "(inference.backend builtin or sglang)", fanout)
    _check(w.replica_deadline_s > 0, "weight_sync.replica_deadline_s", "must be > 0", w.replica_deadline_s)
    if w.transport == "nccl" and not (i.urls or i.replica_file):
        key, devices = server_devices(cfg)
        _check("cpu" not in devices, "weight_sync.transport", f"nccl needs the built-in servers on a GPU ({key})",
               w.transport)
        # Trainer rank k of this node runs on cuda:k (trainer.init_distributed). NCCL cannot
        # join two processes on one GPU, and its error only comes at the first push.
        trainer_gpus = _trainer_gpus()
        for dev in devices:
            gpu = int(dev.partition(":")[2] or 0)
            _check(gpu >= trainer_gpus, key,
                   f"the built-in servers would share cuda:{gpu} with a trainer rank (this node's trainer ranks "
                   f"use cuda:0..cuda:{trainer_gpus - 1}), and NCCL cannot connect two processes on one GPU: "
                   f"put them on cuda:{trainer_gpus} or later, or set weight_sync.transport = \"ipc\" (one GPU for "
                   f"both: the server copies from the trainer's memory), \"gloo\" or \"disk\"",
                   i.server_devices or i.server_device)
    _check(cfg.model.name in ("qwen3", "llama3"), "model.name", 'must be "qwen3" or "llama3"', cfg.model.name)
    _check_model_dir(cfg)
    _check(cfg.training.steps >= 1, "training.steps", "must be >= 1", cfg.training.steps)
    c = cfg.checkpoint
    if c.enable:
        _check(c.interval >= 1, "checkpoint.interval", "must be >= 1", c.interval)
        _check(c.keep_latest_k != 1 and c.keep_latest_k >= 0, "checkpoint.keep_latest_k",
               "must be 0 (keep all) or >= 2 (the newest may still be being written)", c.keep_latest_k)
        _check(c.load_step >= -1, "checkpoint.load_step", "must be -1 (latest) or a saved step", c.load_step)
        _check(not c.last_save_in_hf or c.last_save_model_only, "checkpoint.last_save_in_hf",
               "needs checkpoint.last_save_model_only = true (safetensors hold only the model)", c.last_save_in_hf)
    if c.hf_export:
        _check(bool(c.hf_export_folder), "checkpoint.hf_export_folder", "must not be empty", c.hf_export_folder)
    validate_eval(cfg, _check)
    validate_lora(cfg, _check)
    from torchtitan_grpo.weight_sync.delta_push import validate_delta  # its transport's module: imported on use

    validate_delta(cfg, _check)


def _check_model_dir(cfg) -> None:
    """model.hf_assets_path holds an HF checkpoint (config.json), or it is the
    demo's own default path and grpo.tiny_model_if_missing will write the tiny
    model there. A path the user gave is never created: a typo must not train
    a random model."""
    from torchtitan_grpo.models.demo_assets import DEMO_MODEL_DIR, DEMO_MOE_MODEL_DIR, is_demo_model_dir

    path = cfg.model.hf_assets_path
    if path.lower().endswith(".gguf"):  # dequantised into the dump folder at start-up (models/gguf.py)
        _check(os.path.isfile(path), "model.hf_assets_path", "names a .gguf file that does not exist", path)
        return
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    what = "does not exist" if not os.path.exists(path) else "has no config.json"
    if not cfg.grpo.tiny_model_if_missing:
        _check(False, "model.hf_assets_path", f"{what}: it must be an HF checkpoint directory (config.json, "
                                              "safetensors, tokenizer files)", path)
    _check(is_demo_model_dir(path), "model.hf_assets_path",
           f"{what}; grpo.tiny_model_if_missing writes the tiny demo models only at the demos' own {DEMO_MODEL_DIR} "
           f"and {DEMO_MOE_MODEL_DIR}, never at a path given to it: fix the path, or write the demo model there "
           "first (python -m torchtitan_grpo.models.demo_assets DIR [--moe])", path)


def check_reachable(cfg, timeout_s: float = 10.0) -> None:
    """Every replica in inference.urls answers /health (any status: it is a
    server); else a ConfigError naming the key, before anything starts."""
    import urllib.error
    import urllib.request

    for url in cfg.inference.urls:
        try:
            urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            continue  # it answered (a server starting up or requiring a key)
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(f"config key inference.urls: {url} is not reachable ({reason}); start the "
                              f"server first or fix the URL") from None


def _check_toml_keys(argv: list[str]) -> None:
    """Fail on an unknown section or key, or a value of the wrong type, in the
    TOML file with one line that names it, the nearest valid key and the file
    (TorchTitan's own error for an unknown key is a long dump, and a wrong
    type would pass it and fail later as a TypeError)."""
    from torchtitan.config import ConfigManager
    from torchtitan.config import JobConfig as TitanJobConfig

    from torchtitan_grpo.config.job_config import JobConfig
    from torchtitan_grpo.config.keys import check_toml_values, key_types

    path = None
    for k, a in enumerate(argv):
        key, _, val = a.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = val or (argv[k + 1] if k + 1 < len(argv) else None)
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} (--job.config_file) does not exist")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from e
    check_toml_values(data, key_types(ConfigManager._merge_configs(TitanJobConfig, JobConfig)), path, ConfigError)


def _check_launched_engine(cfg) -> None:
    """A vLLM or SGLang the trainer starts itself (no inference.urls): the
    engine must be importable here, run on a GPU, and take the weights over
    a route it has."""
    import importlib.util

    from torchtitan_grpo.config.job_config import server_devices

    i, w = cfg.inference, cfg.weight_sync
    module = {"vllm": "vllm", "sglang": "sglang"}[i.backend]
    _check(importlib.util.find_spec(module) is not None, "inference.backend",
           f"{i.backend!r} with no inference.urls starts {i.backend} servers, but the {module!r} package is not "
           "importable here: install it, or give the URLs of running servers in inference.urls", i.backend)
    key, devices = server_devices(cfg)
    _check(all(d.startswith("cuda") for d in devices), key,
           f"a started {i.backend} server needs a GPU (\"cuda\" or \"cuda:N\")", i.server_devices or i.server_device)
    transports = ("nccl", "ipc") if i.backend == "vllm" else ("nccl", "ipc", "disk")
    _check(w.mode == "off" or w.transport in transports, "weight_sync.transport",
           f"must be one of {transports} for a started {i.backend} server", w.transport)
    _check(0.0 <= i.gpu_memory_utilization < 1.0, "inference.gpu_memory_utilization",
           "must be in [0, 1) (0: the engine's default)", i.gpu_memory_utilization)
