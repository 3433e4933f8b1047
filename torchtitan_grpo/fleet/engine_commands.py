"""The command line and environment of each engine the trainer can launch.

``inference.backend`` names the engine; with no ``inference.urls`` the trainer
starts the servers itself (``launcher``) and supervises them the same way
whatever they are: /health, restarts on the same port, shutdown. Only the
command differs, and it is built here, one function per engine:

* ``builtin``: our server (``python -m torchtitan_grpo.server``);
* ``vllm``: vLLM's OpenAI server with its RL routes (dev mode) and a weight
  transfer engine, NCCL or CUDA IPC (``weight_sync.transport``);
* ``sglang``: ``python -m sglang.launch_server``.

A real engine runs on a GPU: the device is handed over as
``CUDA_VISIBLE_DEVICES`` (it then sees one GPU, its ``cuda:0``), which is how
both engines are meant to be pinned.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from torchtitan_grpo.protocol.builtin import API_KEY_ENV

ENGINES = ("builtin", "vllm", "sglang")

VLLM_TRANSFER = {"nccl": "nccl", "ipc": "ipc"}
"""``weight_sync.transport`` -> vLLM's ``--weight-transfer-config`` backend."""


@dataclass
class EngineLaunch:
    """What a launched real engine needs beyond ``ServerSpec``'s common fields."""

    gpu_memory_utilization: float = 0.0
    """Share of the GPU's memory the engine may take (vLLM's
    --gpu-memory-utilization, SGLang's --mem-fraction-static); 0 = the
    engine's default (vLLM 0.9), which leaves nothing for a trainer on the
    same GPU."""
    max_model_len: int = 0
    """Its context (vLLM --max-model-len, SGLang --context-length); 0 = the model's."""
    served_model_name: str = ""
    """The name requests must give as ``model`` (vLLM refuses any other)."""
    weight_transfer: str = ""
    """vLLM: "nccl" or "ipc" (its weight-transfer engine); "" = none (no push)."""
    fp64_sampler: bool = False
    """vLLM: --use-fp64-gumbel (``inference.vllm_fp64_sampler``)."""
    args: tuple[str, ...] = field(default_factory=tuple)
    """Appended as they are (``inference.engine_args``)."""


def gpu_env(device: str) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a real engine on ``device`` ("cuda" keeps the caller's)."""
    if device.startswith("cuda:"):
        return {"CUDA_VISIBLE_DEVICES": device.partition(":")[2]}
    if device == "cuda":
        return {}
    raise ValueError(f"a launched vLLM or SGLang server needs a GPU, got device {device!r} "
                     "(inference.server_device / inference.server_devices)")


def launch_flags(e: EngineLaunch, memory_flag: str, context_flag: str) -> list[str]:
    """The served name, memory share and context that are set, under the engine's own flag names
    (vLLM and SGLang both take --served-model-name)."""
    flags = ["--served-model-name", e.served_model_name] if e.served_model_name else []
    if e.gpu_memory_utilization > 0:
        flags += [memory_flag, str(e.gpu_memory_utilization)]
    if e.max_model_len > 0:
        flags += [context_flag, str(e.max_model_len)]
    return flags


def builtin_command(spec, port: int) -> tuple[list[str], dict[str, str]]:
    # The key in the environment: a command line is readable by every user of the host (ps).
    env = {API_KEY_ENV: spec.api_key} if spec.api_key else {}
    return [
        sys.executable, "-m", "torchtitan_grpo.server",
        "--model", spec.model_dir, "--port", str(port), "--host", spec.host,
        "--device", spec.device, "--dtype", spec.dtype, "--seed", str(spec.seed),
        *spec.extra_args,
    ], env


def vllm_command(spec, port: int) -> tuple[list[str], dict[str, str]]:
    e: EngineLaunch = spec.launch
    # The module, not the `vllm` console script: vLLM's engine process
    # re-imports the main module, and that script has no __main__ guard.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_dir,
           "--host", spec.host, "--port", str(port), "--dtype", spec.dtype, "--seed", str(spec.seed),
           # The log-probs of the distribution sampled from (temperature, top-k/p
           # applied): what the loss's importance weights compare the trainer's
           # with. vLLM's default is the raw model's, before temperature.
           "--logprobs-mode", "processed_logprobs"]
    cmd += launch_flags(e, "--gpu-memory-utilization", "--max-model-len")
    # The RL routes (/pause, /init_weight_transfer_engine, /update_weights, ...) exist in dev mode only.
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if spec.host in ("127.0.0.1", "localhost"):
        # Its workers meet at this address (else the one of the default route,
        # which an offline host may not have): a server on this host only.
        env["VLLM_HOST_IP"] = "127.0.0.1"
    if e.weight_transfer:
        cmd += ["--weight-transfer-config", json.dumps({"backend": VLLM_TRANSFER[e.weight_transfer]})]
    if e.weight_transfer == "ipc":
        # vLLM's IPC receiver unpickles the handles an /update_weights body
        # carries and refuses to without this. Any client that reaches the
        # port can then make the server unpickle: the server is bound to
        # inference.host (127.0.0.1 by default) and shares the trainer's host.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if e.fp64_sampler and "--use-fp64-gumbel" not in e.args:
        # fp64 noise in its exponential race: with 0.26's fp32 draws the recipe's
        # completions ran long after the first push and it learned far slower
        # (inference.vllm_fp64_sampler's docstring has the runs).
        cmd.append("--use-fp64-gumbel")
    if spec.api_key:
        env["VLLM_API_KEY"] = spec.api_key  # vLLM reads it there: no key on the command line (ps)
    return cmd + [*e.args, *spec.extra_args], env | gpu_env(spec.device)


def sglang_command(spec, port: int) -> tuple[list[str], dict[str, str]]:
    e: EngineLaunch = spec.launch
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_dir, "--host", spec.host,
           "--port", str(port), "--dtype", spec.dtype, "--random-seed", str(spec.seed)]
    cmd += launch_flags(e, "--mem-fraction-static", "--context-length")
    if spec.api_key:
        # SGLang takes its key on the command line only (the launcher's log shows "***" in its place).
        cmd += ["--api-key", spec.api_key]
    return cmd + [*e.args, *spec.extra_args], gpu_env(spec.device)


COMMANDS = {"builtin": builtin_command, "vllm": vllm_command, "sglang": sglang_command}


def server_command(spec, port: int) -> tuple[list[str], dict[str, str]]:
    """(argv, environment to add) that start ``spec``'s engine on ``port``."""
    if spec.engine not in COMMANDS:
        raise ValueError(f"no launcher for engine {spec.engine!r}; known: {', '.join(COMMANDS)}")
    return COMMANDS[spec.engine](spec, port)
