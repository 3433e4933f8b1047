"""The built-in server against a real vLLM on one GPU: same model files, same
prompts, same HTTP workload, one engine after the other in one process.

Each row: ``seqs`` concurrent samples sent as ``seqs / 8`` requests of
``n = 8`` (a GRPO group each), all at once, every sample forced to ``new``
tokens (``ignore_eos``), temperature 1, logprobs on (the sampled token's;
``--top-logprobs K`` adds the top K). Routes:

  generate     SGLang's /generate (``return_logprob``), the built-in server only
  completions  /v1/completions (``logprobs: K``), both engines
  chat         /v1/chat/completions (``logprobs: true, top_logprobs: K``), both

Engines: ``ours`` (this tree's server), ``vllm``, and ``before``: our server
run from another source tree (``--before-src DIR``, e.g. ``git archive`` of
the baseline commit), so a change's before and after come from one call on
one machine (``x before``; ``--before-routes`` to run it on fewer routes).

The model is a random-weight Qwen3 of the release's shape (``0.6b``, ``4b``;
``tiny`` for CPU tests), written here in bf16 as HF safetensors with a
word-level tokenizer that covers the whole vocabulary (token ``i`` is the
word ``w<i>``), so both engines detokenise every sampled id offline, and a
chat template that renders a message's text as is: the chat route's prompt
``"w12 w7 ..."`` is the same token ids as the other routes'.

Timing: per row one warm-up of the same requests with ``--warmup-tokens``
new tokens each (graphs, allocator, first-request paths; 0: the full
length), then timed runs, each wall clock from the first request sent to the
last reply's last byte, repeated until they add up to ``--min-timed-s`` (at
most 5; ``runs``) and the median kept. tok/s = completion tokens / seconds.
The replies are parsed (and their tokens counted) after the last arrived;
``parse s`` is that time, the client's, beside the row. Before 2026-11-29
14:10 each reply was parsed as it arrived and the last parse was inside
``seconds``, which charged the client's parsing of the bigger OpenAI
replies to the routes (runs up to 150).
``spread s``: the last reply's arrival minus the first's: the host time of
the replies after the first, plus any steps between the requests' ends.
Beside each row the
HBM roofline of its decode steps, weights only:

  roofline tok/s = seqs x HBM bandwidth / weight bytes

(a decode step reads every weight once, bf16, and yields one token per
sequence; KV reads and prefill only lower the real bound). Bandwidth:
``--hbm-tbps``, 4.8 TB/s (H200, NVIDIA's figure) by default.

Time (one H200, measured in issue 50's runs): vLLM takes ~100 s to start per
model, the built-in server ~20-60 s; the whole table (2 shapes x 2 lengths x
2 concurrencies, 3 + 2 routes) does not fit one 10-minute device call, so
run one shape per call (``scripts/device_engine_vllm.sh``)::

  python bench/engine_vs_vllm.py --shapes 0.6b --out OUT     # ~6 min
  python bench/engine_vs_vllm.py --shapes 4b --out OUT       # ~8 min

``--budget-s`` skips what would start past the budget (rows already done
are kept: the table and JSON are rewritten after every row). On CPU
(``--device cpu``, ``--engines ours``, ``--shapes tiny``) it checks the
script itself. vLLM runs in its own environment: ``--vllm-env FILE`` is
sourced before it starts (default ``/tmp/vsite/env.sh`` when present).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.paged_speed import N_PER_PROMPT, make_prompts, shape as paged_shape  # noqa: E402
from torchtitan_grpo import jsonfast  # noqa: E402
from torchtitan_grpo.fleet.launcher import log_tail  # noqa: E402
from torchtitan_grpo.net import free_port  # noqa: E402
from torchtitan_grpo.server.httputil import gc_paused  # noqa: E402

SHAPES = {"0.6b": "qwen3-0.6b", "4b": "qwen3-4b", "tiny": "tiny"}
ROUTES = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
ENGINE_ROUTES = {"ours": ("generate", "completions", "chat"), "before": ("generate", "completions", "chat"),
                 "vllm": ("completions", "chat")}
"""``before``: the built-in server from another source tree (``--before-src``): a change's baseline in the same call."""
DEFAULT_VLLM_ENV = "/tmp/vsite/env.sh"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Renders a conversation as its messages' text, nothing added: the chat prompt is the route's prompt ids."""
VLLM_MISSING = ("error: vLLM is not importable{why}: on the GPU machine run "
                "`bash /tmp/vparts/vllm-install.sh && . /tmp/vsite/env.sh` first (or pass --vllm-env FILE), "
                "or leave vLLM out with --engines ours")


# ---- model files ------------------------------------------------------------ #


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens: 0 pad, 1 EOS, ``w<i>`` for the rest;
    words split on whitespace, decoded joined by spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|pad|>": 0, "<|endoftext|>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|pad|>", "<|endoftext|>"])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|pad|>", "bos_token": None, "add_bos_token": False, "add_eos_token": False,
                   "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}, f, indent=2)


def write_model(out_dir: str, shape_name: str, device: str, vocab: int = 0) -> tuple[int, int]:
    """Random bf16 Qwen3 of ``shape_name`` + tokenizer in ``out_dir``; (weight bytes, vocab).
    Initialised on ``device`` (a 4B model's init on a CPU takes minutes); ``vocab``: another
    vocabulary size than the shape's (0: the shape's)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = asdict(paged_shape(SHAPES[shape_name]))
    torch.manual_seed(fields.pop("seed"))
    if vocab:
        fields["vocab_size"] = vocab
    config = Qwen3Config(**fields, bos_token_id=None, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6,
                         attention_bias=False, torch_dtype="bfloat16")
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, config.vocab_size)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return weight_bytes, config.vocab_size


# ---- requests ----------------------------------------------------------------- #


def request_body(route: str, prompt: list[int], new: int, top: int, model: str) -> dict:
    """One request of ``N_PER_PROMPT`` samples of ``prompt``, in the route's own fields."""
    common = {"temperature": 1.0, "top_p": 1.0, "n": N_PER_PROMPT, "ignore_eos": True}
    if route == "generate":
        return {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": top,
                "sampling_params": {**common, "max_new_tokens": new}}
    if route == "completions":
        return {"model": model, "prompt": prompt, "max_tokens": new, "logprobs": top, **common}
    text = " ".join(f"w{t}" for t in prompt)  # the tokenizer gives the ids back
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_completion_tokens": new,
            "logprobs": True, "top_logprobs": top, **common}


def count(route: str, reply: Any) -> tuple[int, int]:
    """(completion tokens, tokens with a logprob) of one reply."""
    if route == "generate":
        samples = reply if isinstance(reply, list) else [reply]
        return (sum(len(s["output_ids"]) for s in samples),
                sum(len(s["meta_info"].get("output_token_logprobs") or []) for s in samples))
    tokens = reply["usage"]["completion_tokens"]
    if route == "completions":
        return tokens, sum(len((c.get("logprobs") or {}).get("token_logprobs") or []) for c in reply["choices"])
    return tokens, sum(len((c.get("logprobs") or {}).get("content") or []) for c in reply["choices"])


async def run_requests(url: str, route: str, bodies: list[dict]) -> tuple[float, int, int, float, float]:
    """Post every body at once; (seconds, completion tokens, tokens with a logprob, spread, parse):
    seconds from the first request sent to the last reply's last byte; the spread is the last
    reply's arrival minus the first's: the server's host time for the replies after the first
    (building, encoding, sending), plus the steps between their ends when they were admitted in
    several prefills; parse is this client's time to parse every reply, after the last arrived."""
    import aiohttp

    arrived: list[float] = []
    raws: list[bytes] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(body: dict) -> None:
            async with s.post(url + ROUTES[route], json=body) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{ROUTES[route]} answered {r.status}: {raw[:200]!r}")
            arrived.append(time.perf_counter())
            raws.append(raw)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
    secs = max(arrived) - t0
    # Parsed once every reply is in, so that this client's parsing (5 x longer for a chat reply
    # than for /generate's: 0.86 against 0.18 ms for 8 x 128 tokens on CPU) does not hold up the
    # replies still arriving, and counts against no server. With the cyclic collector paused: a
    # chat reply at 1,024 tokens makes a dict per token, and the collector's passes over them cost
    # 3 x the parse (313 vs 91 ms on CPU for 7.7 MB). jsonfast (orjson where installed) as the
    # trainer's pool parses replies.
    p0 = time.perf_counter()
    with gc_paused():
        got = [count(route, jsonfast.loads(raw)) for raw in raws]
    parse = time.perf_counter() - p0
    return secs, sum(g[0] for g in got), sum(g[1] for g in got), max(arrived) - min(arrived), parse


def timed_runs(url: str, route: str, bodies: list[dict], min_s: float, most: int) -> list[tuple]:
    """:func:`run_requests` repeated until the runs add up to ``min_s`` seconds (at most ``most``
    runs): a row of 0.3 s is one scheduler hiccup from a different figure."""
    runs = [asyncio.run(run_requests(url, route, bodies))]
    while sum(r[0] for r in runs) < min_s and len(runs) < most:
        runs.append(asyncio.run(run_requests(url, route, bodies)))
    return runs


# ---- servers ------------------------------------------------------------------ #


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Server:
    engine: str
    url: str
    proc: subprocess.Popen
    log: str
    trace: str | None = None
    """``--trace``: the prefix of its trace pieces (bench/server_trace.py)."""


def _spec(model_dir: str, args: argparse.Namespace, max_len: int) -> Any:
    from torchtitan_grpo.fleet.launcher import ServerSpec

    gpu = args.device != "cpu"
    return ServerSpec(model_dir, device=args.device, dtype="bfloat16" if gpu else "float32", extra_args=(
        "--max-batch-size", str(max(args.seqs)), "--max-model-len", str(max_len), *shlex.split(args.server_args)))


def start_ours(model_dir: str, args: argparse.Namespace, max_len: int, log_dir: str) -> Server:
    if args.trace:
        return start_builtin("ours", None, model_dir, args, max_len, log_dir)
    from torchtitan_grpo.fleet.launcher import start_servers

    (srv,) = start_servers([_spec(model_dir, args, max_len)], log_dir, timeout_s=args.start_timeout_s, attempts=1)
    return Server("ours", srv.url, srv.proc, srv.log_path)


def start_before(model_dir: str, args: argparse.Namespace, max_len: int, log_dir: str) -> Server:
    return start_builtin("before", os.path.abspath(args.before_src), model_dir, args, max_len, log_dir)


def start_builtin(engine: str, src: str | None, model_dir: str, args: argparse.Namespace, max_len: int,
                  log_dir: str) -> Server:
    """Our server, as ``src`` has it (None: this tree): the same command, run in that tree (``-m``
    puts the working directory first on the path) with that tree first on PYTHONPATH. With
    ``--trace``: under ``bench/server_trace.py`` (this tree's), its pieces under the trace folder."""
    from torchtitan_grpo.fleet.engine_commands import server_command

    port = free_port()
    cmd, env = server_command(_spec(model_dir, args, max_len), port)
    here = os.getcwd()
    tree = src or here
    env = dict(os.environ, **env, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p and os.path.abspath(p) != here]))
    log, trace = os.path.join(log_dir, f"{engine}.log"), None
    if args.trace:
        if cmd[1:3] != ["-m", "torchtitan_grpo.server"]:
            raise RuntimeError(f"--trace: not the built-in server's command: {cmd[:3]}")
        trace = os.path.join(os.path.abspath(args.trace), f"{engine}-{os.path.basename(model_dir)}")
        cmd = [cmd[0], os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_trace.py"), trace,
               "--", *cmd[3:]]
    with open(log, "ab") as f:
        f.write(f"=== (in {tree}) {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tree, start_new_session=True)
    srv = Server(engine, f"http://127.0.0.1:{port}", proc, log, trace)
    return _wait_healthy(srv, args.start_timeout_s)


def write_trace_summary(trace_dir: str) -> None:
    from bench.server_trace import summary

    pieces = sorted(f for f in os.listdir(trace_dir) if f.endswith(".json"))
    with open(os.path.join(trace_dir, "summary.md"), "w") as f:
        f.write("\n\n".join(f"# {name}\n" + summary(os.path.join(trace_dir, name)) for name in pieces) + "\n")


def trace_cut(srv: Server, label: str, timeout_s: float = 10.0) -> None:
    """Ask ``bench/server_trace.py`` to write what it sampled since the last cut as ``label``
    (``-``: drop it) and wait until it has."""
    if srv.trace is None:
        return
    ctl = srv.trace + ".ctl"
    with open(ctl + ".tmp", "w") as f:
        f.write(label)
    os.replace(ctl + ".tmp", ctl)
    deadline = time.monotonic() + timeout_s
    while os.path.exists(ctl) and time.monotonic() < deadline:
        time.sleep(0.005)


def vllm_shell(env_file: str | None, command: str) -> list[str]:
    """``command`` under bash with ``env_file`` sourced first (vLLM's own site-packages)."""
    prefix = f". {shlex.quote(env_file)} && " if env_file else ""
    return ["bash", "-c", prefix + command]


def vllm_version(env_file: str | None) -> str:
    """vLLM's version in its environment; exits with one line when it is not importable."""
    r = subprocess.run(vllm_shell(env_file, "python3 -c 'import vllm; print(vllm.__version__)'"),
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(VLLM_MISSING.format(why=f" ({last[:160]})" if last else ""), file=sys.stderr, flush=True)
        sys.exit(2)
    return r.stdout.strip().splitlines()[-1]


def start_vllm(model_dir: str, args: argparse.Namespace, max_len: int, log_dir: str) -> Server:
    port = free_port()
    cmd = (f"exec python3 -m vllm.entrypoints.openai.api_server --model {shlex.quote(model_dir)} --dtype bfloat16 "
           f"--port {port} --seed 0 --gpu-memory-utilization {args.vllm_memory} --max-model-len {max_len}")
    log = os.path.join(log_dir, "vllm.log")
    with open(log, "ab") as f:
        f.write(f"=== {cmd}\n".encode())
        f.flush()
        # A session of its own: stopping it stops its engine-core child too (killpg).
        proc = subprocess.Popen(vllm_shell(args.vllm_env, cmd), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return _wait_healthy(Server("vllm", f"http://127.0.0.1:{port}", proc, log), args.start_timeout_s)


def _wait_healthy(srv: Server, timeout_s: float) -> Server:
    deadline = time.monotonic() + timeout_s
    while not healthy(srv.url):
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            stop(srv)
            why = f"exited ({srv.proc.returncode})" if srv.proc.returncode is not None else "not healthy in time"
            raise RuntimeError(f"{srv.engine} {why}; its log ends:\n{log_tail(srv.log, 25)}")
        time.sleep(2)
    return srv


def stop(srv: Server) -> None:
    """SIGTERM the server's process group (ours: the server; vLLM: API server + engine core), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if srv.proc.poll() is not None:
            break
        try:
            os.killpg(srv.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            srv.proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    time.sleep(2 if srv.engine == "vllm" else 0)  # its engine core frees the GPU after the parent exits


# ---- table -------------------------------------------------------------------- #

COLUMNS = ("engine", "route", "shape", "new", "seqs", "tok/s", "roofline tok/s", "% roofline", "x vLLM",
           "x before", "seconds", "spread s", "parse s", "runs", "tokens", "status")


def compare(rows: list[dict]) -> None:
    """``x vLLM``: a row's tok/s over vLLM's on the same route (/generate against vLLM's /v1/completions);
    ``x before``: our row's over the ``before`` engine's on the same route."""
    def ref(engine: str) -> dict:
        return {(r["route"], r["shape"], r["new"], r["seqs"]): r["tok/s"] for r in rows
                if r["engine"] == engine and r.get("tok/s")}

    vllm, before = ref("vllm"), ref("before")
    for r in rows:
        key = (r["route"], r.get("shape"), r.get("new"), r.get("seqs"))
        base = vllm.get(("completions" if r["route"] == "generate" else r["route"], *key[1:]))
        r["x vLLM"] = round(r["tok/s"] / base, 2) if base and r.get("tok/s") else None
        old = before.get(key) if r["engine"] == "ours" else None
        r["x before"] = round(r["tok/s"] / old, 2) if old and r.get("tok/s") else None


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
    return str(v)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def save(out: str, header: str, rows: list[dict]) -> None:
    compare(rows)
    with open(os.path.join(out, "engine_vs_vllm.md"), "w") as f:
        f.write(header + "\n\n" + table(rows) + "\n")
    with open(os.path.join(out, "engine_vs_vllm.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)


# ---- main --------------------------------------------------------------------- #


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def names(allowed: Any) -> Any:
    def parse(s: str) -> list[str]:
        got = [x for x in s.split(",") if x]
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"{bad or s!r}: choose from {', '.join(allowed)}")
        return got
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=names(SHAPES), default=["0.6b", "4b"])
    ap.add_argument("--lengths", type=ints, default=[128, 1024], help="new tokens per sample")
    ap.add_argument("--seqs", type=ints, default=[64, 256], help=f"concurrent samples (multiples of {N_PER_PROMPT})")
    ap.add_argument("--routes", type=names(ROUTES), default=list(ROUTES))
    ap.add_argument("--engines", type=names(ENGINE_ROUTES), default=["ours", "vllm"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=0,
                    help="vocabulary size instead of the shape's (e.g. the tiny shape with Qwen3's 151936: the "
                         "replies' per-token host cost on CPU)")
    ap.add_argument("--top-logprobs", type=int, default=0, help="top-K logprobs beside the sampled token's")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each row's warm-up (0: the row's)")
    ap.add_argument("--min-timed-s", type=float, default=2.0,
                    help="repeat a row's timed run until the runs add up to this (5 at most); the median is kept")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the roofline (H200: 4.8)")
    ap.add_argument("--vllm-memory", type=float, default=0.85, help="vLLM's --gpu-memory-utilization")
    ap.add_argument("--vllm-env", default=DEFAULT_VLLM_ENV if os.path.exists(DEFAULT_VLLM_ENV) else None,
                    help="shell file sourced before vLLM starts (default /tmp/vsite/env.sh when present)")
    ap.add_argument("--before-src", default=None,
                    help="a source tree of this repo (a baseline commit's): engine 'before' runs our server from it")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--start-timeout-s", type=float, default=400)
    ap.add_argument("--budget-s", type=float, default=0, help="skip what would start after this many seconds (0: none)")
    ap.add_argument("--out", default="outputs/engine_vs_vllm")
    ap.add_argument("--before-routes", type=names(ENGINE_ROUTES["before"]), default=None,
                    help="the before engine's routes (default: --routes)")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more arguments for our servers (ours, before), e.g. '--admission-window-ms 40'")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="run our servers under bench/server_trace.py: each row's stack samples and engine "
                         "timeline (queued, prefills, decode steps, finished) to DIR, summed up in "
                         "DIR/summary.md (the timed runs only; the sampler costs the server a few %% of the GIL)")
    args = ap.parse_args(argv)
    if "before" in args.engines and not (args.before_src and os.path.isdir(
            os.path.join(args.before_src, "torchtitan_grpo"))):
        ap.error(f"--engines before needs --before-src DIR holding a torchtitan_grpo/ package (got {args.before_src!r})")
    if any(s % N_PER_PROMPT for s in args.seqs):
        ap.error(f"--seqs must be multiples of {N_PER_PROMPT} (requests of n={N_PER_PROMPT})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A time limit's SIGTERM unwinds (the finally below stops the running server: vLLM's own session would outlive us).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    over = lambda need=0.0: args.budget_s and time.monotonic() - t_start + need > args.budget_s  # noqa: E731
    vllm_ver = vllm_version(args.vllm_env) if "vllm" in args.engines else None  # before any model is written
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("error: no GPU (pass --device cpu to check the script on a CPU)")
    os.makedirs(args.out, exist_ok=True)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device_name}, torch {torch.__version__}, "
              f"vLLM {vllm_ver or '-'}; bf16 random-weight Qwen3, prompt {args.prompt_len} tokens, requests of "
              f"n={N_PER_PROMPT}, ignore_eos, temperature 1, logprobs on (top {args.top_logprobs}), warm-up "
              f"{args.warmup_tokens or 'full'} tokens, then timed runs until they add up to {args.min_timed_s:g} s (5 at most), the median kept; roofline = seqs x {args.hbm_tbps} TB/s "
              f"/ weight bytes")
    print(header, flush=True)
    print(table([]), flush=True)
    rows: list[dict] = []
    max_len = args.prompt_len + max(args.lengths) + 8
    tmp = tempfile.mkdtemp(prefix="engine_vs_vllm_")
    servers_log = open(os.path.join(args.out, "servers.log"), "a")
    for shape_name in args.shapes:
        model_dir = os.path.join(tmp, f"qwen3-{shape_name}")
        weight_bytes, vocab = write_model(model_dir, shape_name, args.device, args.vocab)
        prompts = make_prompts(max(args.seqs), args.prompt_len, vocab)
        for engine in args.engines:
            wanted = args.before_routes if engine == "before" and args.before_routes else args.routes
            routes = [r for r in wanted if r in ENGINE_ROUTES[engine]]
            if not routes:
                continue
            base = {"engine": engine, "shape": shape_name}
            if over(150 if engine == "vllm" else 60):
                rows.append({**base, "route": ",".join(routes), "status": "skipped: budget"})
                continue
            log_dir = os.path.join(tmp, f"{engine}-{shape_name}")
            os.makedirs(log_dir, exist_ok=True)
            srv = None
            t0 = time.monotonic()
            try:
                start = {"vllm": start_vllm, "before": start_before, "ours": start_ours}[engine]
                srv = start(model_dir, args, max_len, log_dir)
                print(f"# {engine} {shape_name}: up in {time.monotonic() - t0:.0f} s", flush=True)
                for route in routes:
                    for new in args.lengths:
                        for seqs in args.seqs:
                            row = {**base, "route": route, "new": new, "seqs": seqs}
                            rows.append(row)
                            if over():
                                row["status"] = "skipped: budget"
                                continue
                            bodies = [request_body(route, p, new, args.top_logprobs, model_dir)
                                      for p in prompts[: seqs // N_PER_PROMPT]]
                            warm = [request_body(route, p, args.warmup_tokens or new, args.top_logprobs, model_dir)
                                    for p in prompts[: seqs // N_PER_PROMPT]]
                            try:
                                asyncio.run(run_requests(srv.url, route, warm))
                                trace_cut(srv, "-")  # start, warm-up, idle time: dropped
                                runs = timed_runs(srv.url, route, bodies, args.min_timed_s, 5)
                                trace_cut(srv, f"{route}-{new}-{seqs}")
                                secs, tokens, with_lp, spread, parse = sorted(runs)[len(runs) // 2]  # the median
                                roof = seqs * args.hbm_tbps * 1e12 / weight_bytes
                                row.update({"tok/s": tokens / secs, "roofline tok/s": roof,
                                            "% roofline": round(100 * tokens / secs / roof, 1),
                                            "seconds": round(secs, 2), "spread s": round(spread, 3),
                                            "parse s": round(parse, 4),
                                            "runs": len(runs), "tokens": tokens,
                                            "status": "ok" if tokens == with_lp == seqs * new else
                                            f"tokens {tokens}, with logprob {with_lp}, expected {seqs * new}"})
                            except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
                                row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
                            print(table([row]).splitlines()[-1], flush=True)
                            save(args.out, header, rows)
            except Exception as e:  # noqa: BLE001 - the other engine still runs
                rows.append({**base, "route": ",".join(routes), "status": f"error: {type(e).__name__}: {str(e)[:300]}"})
                print(f"# {engine} {shape_name}: {rows[-1]['status']}", flush=True)
            finally:
                if srv is not None:
                    stop(srv)
                for name in sorted(os.listdir(log_dir)):  # each server's log tail, one file for all
                    servers_log.write(f"==== {engine} {shape_name} {name}\n{log_tail(os.path.join(log_dir, name), 40)}\n")
                servers_log.flush()
                save(args.out, header, rows)
    print("\n" + header + "\n\n" + table(rows), flush=True)
    if args.trace:
        write_trace_summary(args.trace)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
