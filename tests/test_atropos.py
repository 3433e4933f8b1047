"""The Atropos rollout source against atroposlib's own API server (a real
uvicorn subprocess, fed ScoredData as an environment posts it), its
example environment and atroposlib's server handlers against the built-in
server. The conversion of groups and multi-turn packing, which need no
process: tests/test_atropos_groups.py. Waits are hang guards only."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_procs import free_port
from tests.test_atropos_groups import multi_turn_group, own_advantage_group
from torchtitan_grpo.rollout.atropos import AtroposConfig, AtroposSource
from torchtitan_grpo.rollout.atropos_groups import convert_group
from torchtitan_grpo.rollout.producer import ProducerStopped

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ helpers


@dataclass
class AtroposAPI:
    """atroposlib's FastAPI app under uvicorn, on a fixed port (restartable there)."""

    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        pytest.importorskip("atroposlib")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise AssertionError(f"Atropos API did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def call(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def post_group(self, group: dict) -> None:
        """What BaseEnv._send_scored_data_to_api sends (JSON; env_id when registered)."""
        reply = self.call("POST", "/scored_data", group)
        assert reply["status"] in ("received", "buffered"), reply


@pytest.fixture
def api(tmp_path):
    pytest.importorskip("atroposlib")
    a = AtroposAPI(free_port(), tmp_path / "atropos_api.log")
    a.start()
    yield a
    a.stop()


@pytest.fixture(scope="module")
def server(generating_server):
    """The session's generate-only server (conftest): nothing here pushes weights to it or pauses it."""
    return generating_server


def make_source(url: str, batch_size: int, **kw) -> AtroposSource:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in AtroposConfig.__dataclass_fields__}
    cfg = AtroposConfig(url=url, batch_size=batch_size, max_token_len=cfg_kw.pop("max_token_len", 64),
                        num_steps=cfg_kw.pop("num_steps", 10), checkpoint_dir="/tmp/ckpt", checkpoint_interval=5,
                        startup_timeout_s=cfg_kw.pop("startup_timeout_s", 30), poll_max_s=0.2,
                        **cfg_kw)
    src = AtroposSource(cfg, **kw)
    src.start(0)
    return src


class Pull:
    """``next_batch`` on a thread (it blocks until Atropos has a batch)."""

    def __init__(self, src: AtroposSource, stop: threading.Event | None = None):
        self.result, self.error = None, None
        self.stop = stop or threading.Event()
        self.t = threading.Thread(target=self._run, args=(src,), daemon=True)
        self.t.start()

    def _run(self, src):
        try:
            self.result = src.next_batch(self.stop)
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def get(self, timeout: float = 60.0):
        self.t.join(timeout)
        assert not self.t.is_alive(), "next_batch hung"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(pred, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------ against the real API


def test_registers_pulls_and_converts_exactly(api):
    src = make_source(api.url, batch_size=4, scale_rewards=True, vocab_size=32)
    p = Pull(src)
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 4, what="registration")
    assert api.call("GET", "/info") == {"batch_size": 4, "max_token_len": 64}
    api.post_group(multi_turn_group())
    api.post_group(own_advantage_group())
    batch = p.get()
    direct = convert_group(multi_turn_group()).samples + convert_group(own_advantage_group()).samples
    assert batch.samples == direct  # byte-for-byte what the groups say, in the order they were queued
    assert batch.indices == [0, 1]
    m = batch.metrics
    for key in ("time/wait_s", "time/generate_s", "rollout/tokens_per_s", "reward/mean", "reward/std"):
        assert key in m and math.isfinite(m[key])
    assert m["reward/mean"] == pytest.approx(0.5) and m["atropos/dropped_groups"] == 0
    assert m["rollout/tokens"] == 12.0 and not any(k.startswith("_") for k in m)
    assert api.call("GET", "/status")["current_step"] == 1 == src.step
    assert src.state_dict()["step"] == 1
    src.close()


def test_null_batches_back_off_log_and_stop(api, caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=2, log_every_s=0.3)
    stop = threading.Event()
    p = Pull(src, stop)
    wait_until(lambda: any("waiting for Atropos: queue 0" in r.message for r in caplog.records), what="the wait log")
    stop.set()
    assert p.get() is None  # a stop request ends the wait
    waits = [r for r in caplog.records if "waiting for Atropos" in r.message]
    assert len(waits) >= 1
    # data arrives: the next call returns it
    api.post_group(own_advantage_group())
    batch = Pull(src).get()
    assert len(batch.samples) == 2
    src.close()


def test_malformed_groups_are_dropped_once_logged_and_counted(api, caplog):
    caplog.set_level(logging.WARNING, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=12, vocab_size=32)
    p = Pull(src)
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 12, what="registration")
    bad_shape = multi_turn_group()
    bad_shape["masks"][0].pop()
    all_masked = multi_turn_group()
    all_masked["masks"] = [[-100] * 9, [-100] * 9]
    no_lp = multi_turn_group()
    no_lp.pop("inference_logprobs")
    too_long = own_advantage_group()
    too_long["tokens"][0] = [1] * 70
    too_long["masks"][0] = [-100] * 68 + [1, 1]
    too_long["inference_logprobs"][0] = [1.0] * 68 + [-0.1, -0.1]
    too_long.pop("advantages")
    for g in (bad_shape, all_masked, bad_shape, no_lp, too_long, multi_turn_group()):
        api.post_group(g)
    batch = p.get()
    assert len(batch.samples) == 2
    m = batch.metrics
    assert m["atropos/dropped_groups"] == 5 and m["atropos/dropped_shape"] == 2
    assert m["atropos/dropped_all_masked"] == m["atropos/dropped_no_logprobs"] == m["atropos/dropped_too_long"] == 1
    drops = [r.message for r in caplog.records if "dropped an Atropos group" in r.message]
    assert len(drops) == 4, drops  # one line per kind
    src.close()


def test_survives_api_restarts(api, caplog):
    """Restarted between two steps (the API forgets the trainer: /batch says
    so) and restarted while the trainer waits (refused connections): the
    source re-registers with its step each time and the step is not lost."""
    caplog.set_level(logging.INFO, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=2, num_steps=7)
    p = Pull(src)
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 2, what="registration")
    api.post_group(own_advantage_group())
    assert len(p.get().samples) == 2
    assert src.step == 1

    api.stop()  # between steps
    api.start()
    # An environment posts to the fresh API before the trainer is back: atroposlib
    # then cannot register a trainer until it is reset (the source does so; that group is lost).
    api.post_group(multi_turn_group())
    p = Pull(src)
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 2, what="re-registration")
    api.post_group(own_advantage_group())
    batch = p.get()
    # re-registered twice: once told it is unknown, once more after the reset
    assert batch.samples == convert_group(own_advantage_group()).samples and src.reregistrations == 2
    assert any("does not know this trainer" in r.message for r in caplog.records)
    assert any("/reset_data" in r.message for r in caplog.records)
    assert api.call("GET", "/status")["current_step"] == 2  # registered at step 1, then one batch

    p = Pull(src)  # waiting on an empty queue
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 2, what="the waiting poll")
    api.stop()  # while the trainer waits
    wait_until(lambda: any("does not answer" in r.message for r in caplog.records), what="the outage log")
    api.start()
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 2, what="re-registration")
    api.post_group(own_advantage_group())
    batch = p.get()
    assert len(batch.samples) == 2 and src.reregistrations == 3
    assert any("answers again" in r.message for r in caplog.records)
    assert api.call("GET", "/status")["current_step"] == 3
    assert src.step == 3
    src.close()


def test_unreachable_at_start_names_the_url():
    port = free_port()  # nothing listens there
    src = make_source(f"http://127.0.0.1:{port}", batch_size=2, startup_timeout_s=1.0)
    with pytest.raises(ProducerStopped) as e:
        Pull(src).get(timeout=60)
    msg = str(e.value)
    assert "rollout.atropos_url" in msg and f"127.0.0.1:{port}" in msg and "\n" not in msg


# ------------------------------------------------------------------ the example environment


def _load_example_env():
    import importlib.util

    pytest.importorskip("atroposlib")
    spec = importlib.util.spec_from_file_location("digits_env", REPO / "examples" / "atropos" / "digits_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_env_samples_from_the_builtin_server(api, server, model_dir):
    """examples/atropos/digits_env.py: atroposlib's SGLangServer handler gets
    tokens and log-probs from the built-in server over two turns; the group
    it posts trains exactly the model's tokens."""
    import asyncio

    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    mod = _load_example_env()
    env_cfg, _ = mod.DigitsTwoTurnEnv.config_init()
    env_cfg = env_cfg.model_copy(update={"tokenizer_name": model_dir, "group_size": 4})
    server_cfg = APIServerConfig(model_name=model_dir, base_url=server + "/v1", api_key="x", server_type="sglang",
                                 health_check=False, timeout=60)
    env = mod.DigitsTwoTurnEnv(env_cfg, [server_cfg])

    async def one_group():
        await env.setup()
        return await env.collect_trajectories({"prompt": "3>", "answer": "0"})

    group, backlog = asyncio.run(one_group())
    assert backlog == [] and len(group["tokens"]) == 4
    prompt = env.tokenizer.encode("3>", add_special_tokens=False)
    for toks, masks, lps in zip(group["tokens"], group["masks"], group["inference_logprobs"]):
        assert toks[: len(prompt)] == prompt and len(toks) == len(masks) == len(lps)
        trained = [j for j, m in enumerate(masks) if m != -100]
        assert all(masks[j] == toks[j] for j in trained) and all(lps[j] <= 0 for j in trained)
        assert all(lps[j] == 1.0 for j in range(len(toks)) if j not in trained)
        assert any(m == -100 for m in masks[trained[0]:])  # the environment's reply sits between the turns

    src = make_source(api.url, batch_size=4)
    p = Pull(src)
    wait_until(lambda: api.call("GET", "/info")["batch_size"] == 4, what="registration")
    api.post_group({**group, "env_id": None})
    batch = p.get()
    assert batch.metrics["atropos/dropped_groups"] == 0
    for s, toks, masks in zip(batch.samples, group["tokens"], group["masks"]):
        trained = [t for t, m in zip(s.completion_ids, s.loss_mask or [1.0] * len(s.completion_ids)) if m]
        assert trained == [m for m in masks if m != -100]
        assert s.prompt_ids + s.completion_ids == toks[: len(s.prompt_ids) + len(s.completion_ids)]
    src.close()


# ------------------------------------------------------------------ atroposlib's server handlers


@pytest.fixture(scope="module")
def chat_model(model_dir, tmp_path_factory) -> str:
    """The tiny model with a chat template of its own (the demo tokenizer has
    none): ManagedServer renders chats client-side with the same tokenizer."""
    from tests.server_procs import model_with_chat_template

    return model_with_chat_template(model_dir, tmp_path_factory.mktemp("chat-model") / "tiny-qwen3-chat")


@pytest.fixture(scope="module")
def chat_server(chat_model, tmp_path_factory):
    from tests.server_procs import start_server, stop_server

    log = tmp_path_factory.mktemp("chat-logs") / "server.log"
    proc, url = start_server(chat_model, log)
    yield url
    stop_server(proc, log)


class RecordingProxy:
    """Forwards every request to ``upstream`` and records ``(path, JSON body)``:
    what atroposlib's handlers really send, field by field."""

    def __init__(self, upstream: str):
        import asyncio

        self.upstream, self.bodies = upstream, []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="recording-proxy", daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> str:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession()

        async def forward(request: web.Request) -> web.Response:
            raw = await request.read()
            self.bodies.append((request.path, json.loads(raw) if raw else None))
            async with self.session.request(request.method, self.upstream + request.path_qs, data=raw,
                                            headers={"Content-Type": "application/json"}) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def close(self) -> None:
        import asyncio

        async def stop():
            await self.session.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def sent(self, path: str) -> list[dict]:
        return [b for p, b in self.bodies if p == path]


def test_atroposlib_handlers_get_tokens_and_logprobs(chat_server, chat_model):
    """atroposlib's real handlers against the built-in server: OpenAIServer
    (``server_type = "openai"``) gets chat and text completions with token ids
    and logprobs; ManagedServer over SGLangServer and over VLLMServer (both
    post /generate, each in its own protocol's body) tracks the same tokens,
    masks and logprobs over two turns; every field they send is one the
    server reads under vLLM's (or SGLang's) name, none ignored."""
    import asyncio

    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.openai_server import OpenAIServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.sglang_server import SGLangServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer
    from transformers import AutoTokenizer

    from torchtitan_grpo.server.routes import vllm_chat, vllm_generate
    from torchtitan_grpo.server.routes.sglang import SGLANG_SAMPLING_KEYS

    tok = AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "user", "content": "3>"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(rendered, add_special_tokens=False)
    proxy = RecordingProxy(chat_server)

    def config(kind: str) -> APIServerConfig:
        return APIServerConfig(model_name=chat_model, base_url=proxy.url + "/v1", api_key="x", server_type=kind,
                               health_check=False, timeout=60)

    async def run():
        openai_server = OpenAIServer(config("openai"))
        sampled = await openai_server.chat_completion(messages=messages, n=3, max_tokens=6, temperature=1.0,
                                                      top_p=1.0, logprobs=True, top_logprobs=2,
                                                      extra_body={"return_token_ids": True})
        greedy = await openai_server.chat_completion(messages=messages, n=1, max_tokens=6, temperature=0.0,
                                                     logprobs=True, extra_body={"return_token_ids": True})
        text = await openai_server.completion(prompt=rendered, n=2, max_tokens=4, logprobs=1,
                                              extra_body={"return_token_ids": True})
        nodes = {}
        for kind, cls in (("sglang", SGLangServer), ("vllm", VLLMServer)):
            managed = ManagedServer(cls(config(kind)), tokenizer=tok)
            first = await managed.chat_completion(messages=messages, n=2, max_tokens=6, temperature=0.0)
            before = managed.get_state()["nodes"]
            turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "+3>"}]
            await managed.chat_completion(messages=turn2, n=1, max_tokens=4, temperature=0.0)
            nodes[kind] = (before, managed.get_state()["nodes"], turn2)
        return sampled, greedy, text, nodes

    try:
        sampled, greedy, text, nodes = asyncio.run(run())
    finally:
        proxy.close()

    # OpenAIServer: n choices, each with its token ids and one logprob entry per token
    assert len(sampled.choices) == 3 and sampled.prompt_token_ids == prompt_ids
    for c in sampled.choices:
        ids, content = c.token_ids, c.logprobs.content
        assert ids and len(content) == len(ids) and c.finish_reason in ("stop", "length")
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
        assert [e.top_logprobs[0].token for e in content] == [e.token for e in content]  # the sampled token first
        assert c.message.content == tok.decode(ids, skip_special_tokens=True)
    (g,) = greedy.choices
    greedy_lps = [e.logprob for e in g.logprobs.content]
    assert len(text.choices) == 2 and all(len(c.token_ids) == len(c.logprobs.token_logprobs) for c in text.choices)

    # ManagedServer: the same greedy tokens and logprobs over either /generate body
    for kind, (before, after, turn2) in nodes.items():
        assert len(before) == 2 and len(after) == 2, kind
        node = before[0]
        out = node.tokens[len(prompt_ids):]
        assert node.tokens[: len(prompt_ids)] == prompt_ids and out == g.token_ids, kind
        assert node.masked_tokens == [-100] * len(prompt_ids) + out
        assert node.logprobs[: len(prompt_ids)] == [1.0] * len(prompt_ids)
        assert max(abs(a - b) for a, b in zip(node.logprobs[len(prompt_ids):], greedy_lps)) <= 1e-5, kind
        # turn 2 extends turn 1: the environment's tokens masked, both model turns trained
        ext = after[0]
        suffix = tok.encode(tok.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)[
            len(node.full_text):], add_special_tokens=False)
        tail = len(ext.tokens) - len(node.tokens) - len(suffix)
        assert tail >= 1 and ext.tokens[: len(node.tokens) + len(suffix)] == node.tokens + suffix, kind
        assert ext.masked_tokens == node.masked_tokens + [-100] * len(suffix) + ext.tokens[-tail:], kind
        assert ext.logprobs[: len(node.tokens)] == node.logprobs and all(lp <= 0 for lp in ext.logprobs[-tail:])
    assert [n.tokens for n in nodes["sglang"][1]] == [n.tokens for n in nodes["vllm"][1]]

    # what the handlers sent: every field one the server reads, under vLLM's / SGLang's names
    chats = proxy.sent("/v1/chat/completions")
    assert len(chats) == 2 and {"messages", "n", "max_tokens", "logprobs", "top_logprobs", "return_token_ids"} <= set(
        chats[0])
    for body in chats:
        assert set(body) <= vllm_chat.KNOWN_FIELDS, set(body) - vllm_chat.KNOWN_FIELDS
    (completion,) = proxy.sent("/v1/completions")
    assert {"prompt", "n", "max_tokens", "logprobs", "return_token_ids"} <= set(completion)
    generates = proxy.sent("/generate")
    vllm_bodies = [b for b in generates if "prompt" in b]
    sglang_bodies = [b for b in generates if "input_ids" in b]
    assert len(vllm_bodies) == len(sglang_bodies) == 2
    for b in vllm_bodies:
        assert set(b) - {"prompt"} <= vllm_generate.SAMPLING_FIELDS and set(b["prompt"]) == {"prompt_token_ids"}
        assert b["logprobs"] == 0
    for b in sglang_bodies:
        assert b["return_logprob"] is True and set(b["sampling_params"]) <= SGLANG_SAMPLING_KEYS
