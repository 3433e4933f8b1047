"""Delta push (weight_sync.delta, issue 41): the codec (weight_sync/delta.py),
the trainer's transport (weight_sync/delta_push.py) and the built-in
server's route (server/receive/delta.py), in this process, on the demo's
tiny Qwen3 served in bf16.

Every comparison is of raw bits (``delta.bits``): ``torch.equal`` would call
-0.0 equal to 0.0 and a NaN unequal to itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.weight_sync import delta

SERVER = ["--port", "0", "--dtype", "bfloat16"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(delta.bits(a), delta.bits(b))


def _special(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """Random values with -0.0, +0.0, +-inf and NaNs of several payloads among them."""
    t = torch.randn(n, generator=g).to(dtype)
    raw = delta.bits(t)
    nan = {torch.bfloat16: [0x7FC0, 0x7FC1, -0x0040], torch.float32: [0x7FC00000, 0x7FC00001, -0x00400000]}[dtype]
    specials = torch.tensor([-(2 ** (8 * t.element_size() - 1)), 0, *nan], dtype=raw.dtype)  # -0.0, +0.0, NaNs
    where = torch.randint(0, n, (n // 10,), generator=g)
    raw[where] = specials[torch.randint(0, len(specials), (len(where),), generator=g)]
    t[:2] = torch.tensor([float("inf"), float("-inf")])
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.05, 0.5, 0.99, 1.0])
def test_codec_round_trip_is_bit_equal(dtype, fraction):
    g = torch.Generator().manual_seed(int(fraction * 1000) + dtype.itemsize)
    base = _special(dtype, 20_000, g).reshape(100, 200)
    new = base.clone()
    flat = delta.bits(new)
    k = int(fraction * flat.numel())
    pos = torch.randperm(flat.numel(), generator=g)[:k]
    flat[pos] = delta.bits(_special(dtype, max(k, 2), g))[:k]
    # sign flips of zeros and NaN payload changes must count as changes
    zeros = (delta.bits(base) == 0).nonzero().reshape(-1)[:3]
    flat[zeros] = -(2 ** (8 * dtype.itemsize - 1))  # +0.0 -> -0.0
    assert delta.encode("w", base, base.clone()) is None  # NaNs equal to themselves: nothing to send
    d = delta.encode("w", base, new)
    changed = int(torch.ne(delta.bits(base), delta.bits(new)).sum())
    assert d.changed == changed
    item, numel = new.element_size(), new.numel()
    smaller = min(4 * changed, (numel + 7) // 8) + item * changed  # indices or a bitmap, and the values
    assert d.full == (smaller >= numel * item)
    if not d.full:
        assert d.nbytes == smaller < numel * item
        assert d.bitmap == (changed > numel / 32)  # a bitmap once it is smaller than int32 indices
    header, (got,) = delta.decode_body(bytearray(delta.encode_body("2", "1", [d])))
    assert header["version"] == "2" and header["base_version"] == "1"
    assert _same_bits(delta.apply(base, got), new)
    assert _same_bits(delta.apply(base, d), new)


def test_codec_refuses_a_wrong_base_and_malformed_bodies():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g).bfloat16()
    new = base.clone()
    new[3, :5] += 1
    d = delta.encode("w", base, new)
    other = base.clone()
    other[10, 10] += 1  # not the version the delta was made against
    with pytest.raises(delta.DeltaMismatch, match="CRC-32"):
        delta.apply(other, d)
    body = delta.encode_body("2", "1", [d])
    for bad, match in [(body[:-3], "ends at byte"), (body + b"xx", "bytes past its last tensor"),
                       (b"XXXX" + body[4:], "not a delta body")]:
        with pytest.raises(delta.DeltaError, match=match):
            delta.decode_body(bytearray(bad))
    assert not d.bitmap
    out_of_range = delta.TensorDelta("w", d.dtype, d.shape, d.values, d.index + 64 * 64, d.crc)
    with pytest.raises(delta.DeltaError, match="out of range"):
        delta.decode_body(bytearray(delta.encode_body("2", "1", [out_of_range])))
    dense = base.clone()
    dense[:8] += 1  # 1 in 8 elements: positions as a bitmap
    b = delta.encode("w", base, dense)
    assert b.bitmap
    extra = b.index.clone()
    extra[-1] |= 1  # one more marked element than values sent
    with pytest.raises(delta.DeltaError, match="the bitmap marks"):
        delta.decode_body(bytearray(delta.encode_body("2", "1", [delta.TensorDelta(
            "w", b.dtype, b.shape, b.values, extra, b.crc)])))


# ----------------------------------------------------------------- with a server


def _versions(model_dir: str, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` float32 versions, each a sparse random step away from the one
    before (2% of the elements of every tensor, at least one; all of one
    tensor, which then goes whole; none of another, which is not sent)."""
    w = {k: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    g = torch.Generator().manual_seed(7)
    names = sorted(w)
    out = []
    for v in range(n):
        w = {k: t.clone() for k, t in w.items()}
        for i, k in enumerate(names):
            if i == 1:
                continue  # unchanged: not sent at all
            flat = w[k].view(-1)
            pos = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * (1.0 if i == 2 else 0.02)))]
            flat[pos] += 0.25 + torch.rand(len(pos), generator=g)  # large enough to change every bf16 picked
        out.append(w)
    return out


def _served(engine) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in engine.model.state_dict().items()}


class Driver:
    """The delta transport driven by hand (no Pusher): which replica gets
    which version is the test's to choose."""

    def __init__(self, urls: list[str], **cfg):
        from torchtitan_grpo.aio import LoopThread
        from torchtitan_grpo.weight_sync.push_config import PushConfig
        from torchtitan_grpo.weight_sync.pusher import make_transport
        from torchtitan_grpo.weight_sync.staging import StagingBuffers
        from torchtitan_grpo.weight_sync.transport import Replica

        self.loop = LoopThread()
        cfg = PushConfig(backend="delta", dtype=torch.bfloat16, deadline_s=60, num_staging_buffers=4, **cfg)
        self.transport = make_transport(cfg, torch.device("cpu"))
        self.staging = StagingBuffers(cfg, torch.device("cpu"), self.transport)
        self.replicas = [Replica(u) for u in urls]
        self.loop.run(self.transport.start())
        for r in self.replicas:
            self.loop.run(self.transport.connect(r))
        self.loop.run(self.transport.tag(self.replicas, 0))
        for r in self.replicas:
            r.version = 0

    def send(self, tensors: dict[str, torch.Tensor], version: int, to: list[int]) -> None:
        self.staging.replan(tensors)
        s = self.staging.free_buffer()
        s.start_writing()
        self.staging.stage(s, tensors)
        s.done_writing()
        self.staging.publish(s, version)
        for k in to:
            r = self.replicas[k]
            taken = self.staging.take(r)
            try:
                self.loop.run(self.transport.send(r, taken))
                r.version = version
            finally:
                self.staging.give_back(r, taken)

    def close(self) -> None:
        self.loop.run(self.transport.close(self.replicas))
        self.loop.close()


def test_three_versions_by_delta_are_bit_equal_to_a_full_push(tiny_model_dir):
    from tests.server_procs import in_process_server
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    versions = _versions(tiny_model_dir, 3)
    with in_process_server(["--model", tiny_model_dir, *SERVER]) as (url, engine):
        loop = LoopThread()
        pusher = Pusher(loop, [url], PushConfig(mode="sync", backend="delta", dtype=torch.bfloat16, deadline_s=60),
                        torch.device("cpu"))
        try:
            pusher.connect(initial_version=0)
            for v, tensors in enumerate(versions, start=1):
                pusher.push(tensors, v)
                assert engine.weight_version == str(v)
            history = pusher.transport.history
        finally:
            pusher.close()
            loop.close()
        by_delta = _served(engine)
        weights = json.loads(urllib.request.urlopen(
            url + "/get_weights_by_name?name=model.norm.weight&truncate_size=1000", timeout=30).read())
    with in_process_server(["--model", tiny_model_dir, *SERVER]) as (url, engine):
        loop = LoopThread()
        pusher = Pusher(loop, [url], PushConfig(mode="sync", backend="gloo", dtype=torch.bfloat16, deadline_s=60),
                        torch.device("cpu"))
        try:
            pusher.connect(initial_version=0)
            for v, tensors in enumerate(versions, start=1):
                pusher.push(tensors, v)
        finally:
            pusher.close()
            loop.close()
        by_full = _served(engine)
    assert by_delta.keys() == by_full.keys()
    for k in by_full:
        assert _same_bits(by_delta[k], by_full[k]), k
    # what the server answers for a weight is the pushed version's, in bf16
    assert weights == versions[-1]["model.norm.weight"].bfloat16().float().tolist()
    # version 1 whole (the replica's weights came from disk), 2 and 3 as deltas: smaller, one tensor not sent
    assert [h["base"] for h in history] == [None, 1, 2]
    full = history[0]["full_bytes"]
    assert history[0]["bytes"] >= full and all(h["bytes"] < 0.3 * full for h in history[1:])
    assert all(h["tensors_sent"] == len(versions[0]) - 1 and h["whole_tensors"] == 1 for h in history[1:])


def test_a_replica_that_missed_a_version_gets_it_whole(tiny_model_dir):
    from tests.server_procs import http_json, in_process_server

    versions = _versions(tiny_model_dir, 4)
    with in_process_server(["--model", tiny_model_dir, *SERVER]) as (url_a, a), \
            in_process_server(["--model", tiny_model_dir, *SERVER]) as (url_b, b):
        drv = Driver([url_a, url_b])
        try:
            drv.send(versions[0], 1, to=[0, 1])
            drv.send(versions[1], 2, to=[0])  # b misses version 2
            drv.send(versions[2], 3, to=[0, 1])  # bases kept: 2 and 3; b holds 1
            # a restarted (or otherwise changed) replica: it no longer serves the base it was sent against
            status, _ = http_json(url_a + "/update_weight_version", json.dumps({"new_version": "77"}).encode(),
                                  "POST", timeout=30)
            assert status == 200
            drv.send(versions[3], 4, to=[0, 1])
            history = drv.transport.history
        finally:
            drv.close()
        assert a.weight_version == b.weight_version == "4"
        want = {k: t.bfloat16() for k, t in versions[3].items()}
        for engine in (a, b):
            served = _served(engine)
            for k, t in want.items():
                assert _same_bits(served[k], t), k
    got = [(h["url"], h["version"], h["base"]) for h in history]
    assert got == [(url_a, 1, None), (url_b, 1, None), (url_a, 2, 1), (url_a, 3, 2),
                   (url_b, 3, None),  # its version 1 is no longer kept: whole, without asking
                   (url_a, 4, None),  # sent against 3, answered 409 (it serves "77"): whole
                   (url_b, 4, 3)]


def test_a_corrupt_delta_is_refused_in_one_line_and_the_previous_version_serves(tiny_model_dir):
    from tests.server_procs import http_json, in_process_server
    from torchtitan_grpo.server.receive.delta import DELTA_ROUTE

    versions = _versions(tiny_model_dir, 2)
    with in_process_server(["--model", tiny_model_dir, *SERVER]) as (url, engine):
        drv = Driver([url])
        try:
            drv.send(versions[0], 1, to=[0])
        finally:
            drv.close()
        before = _served(engine)
        new = {k: t.bfloat16() for k, t in versions[1].items()}
        deltas = [d for k, t in new.items() if (d := delta.encode(k, before[k], t)) is not None]
        d = next(x for x in deltas if not x.full)
        corrupt = [x for x in deltas if x is not d] + [delta.TensorDelta(
            d.name, d.dtype, d.shape, d.values.clone().add_(1), d.index, d.crc)]
        bodies = {
            "CRC-32 differs": (409, delta.encode_body("2", "1", corrupt)),
            "ends at byte": (400, delta.encode_body("2", "1", deltas)[:-10]),
            "unknown parameter": (400, delta.encode_body("2", "1", [delta.TensorDelta(
                "model.nope.weight", d.dtype, d.shape, d.values, d.index, d.crc)])),
            "against version '0'": (409, delta.encode_body("2", "0", deltas)),
        }
        for match, (want, body) in bodies.items():
            status, out = http_json(url + DELTA_ROUTE, body, "POST", timeout=60)
            assert status == want and out["success"] is False, (match, out)
            assert match in out["message"] and "\n" not in out["message"], out
            assert out.get("full_push_needed", False) == (want == 409), out
            assert engine.weight_version == "1"
            served = _served(engine)
            assert all(_same_bits(served[k], before[k]) for k in before), match
        # the good body still applies afterwards
        status, out = http_json(url + DELTA_ROUTE, delta.encode_body("2", "1", deltas), "POST", timeout=60)
        assert status == 200 and out["success"], out
        served = _served(engine)
        assert engine.weight_version == "2" and all(_same_bits(served[k], new[k]) for k in new)


def test_delta_is_refused_for_sglang_and_vllm_naming_the_key():
    from types import SimpleNamespace

    from torchtitan_grpo.config.checks import ConfigError, _check
    from torchtitan_grpo.weight_sync.delta_push import validate_delta

    def cfg(backend: str, on: bool):
        return SimpleNamespace(weight_sync=SimpleNamespace(delta=on), inference=SimpleNamespace(backend=backend))

    for backend in ("sglang", "vllm"):
        with pytest.raises(ConfigError, match=f"weight_sync.delta = True: needs inference.backend = .builtin. "
                                              f"\\(got '{backend}'\\)") as e:
            validate_delta(cfg(backend, True), _check)
        assert "\n" not in str(e.value)
    validate_delta(cfg("sglang", False), _check)  # off: nothing to check


def test_the_transport_refuses_a_replica_that_is_not_the_built_in_server():
    from aiohttp import web

    from torchtitan_grpo.weight_sync.control import PushError
    from torchtitan_grpo.weight_sync.delta_push import DeltaPush
    from torchtitan_grpo.weight_sync.push_config import PushConfig
    from torchtitan_grpo.weight_sync.transport import Replica

    async def run():
        app = web.Application()
        async def model_info(request):
            return web.json_response({"model_path": "x"})  # SGLang's: no "engine" field

        app.router.add_get("/model_info", model_info)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        t = DeltaPush(PushConfig(backend="delta"), torch.device("cpu"))
        await t.start()
        try:
            with pytest.raises(PushError, match="weight_sync.delta"):
                await t.connect(Replica(f"http://127.0.0.1:{port}"))
        finally:
            await t.close([])
            await runner.cleanup()

    asyncio.run(run())


def test_demo_trains_with_delta_pushes_on_policy(tmp_path, tiny_model_dir):
    """The CPU demo with weight_sync.delta: every version through the delta
    transport, and every rollout the trainer's own policy (sync push, serial
    loop): a server that dropped or misplaced a delta would show in the mismatch."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dump = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(root, "grpo_train.py"), "--job.config_file",
           os.path.join(root, "train_configs", "demo_cpu.toml"), "--model.hf_assets_path", tiny_model_dir,
           "--job.dump_folder", dump, "--training.steps", "4", "--optimizer.lr", "1e-4",
           "--weight_sync.delta", "true", "--weight_sync.mode", "sync", "--rollout.pipeline_depth", "0",
           "--rollout.reward_fn", "tests.reward_fixtures:varies_with_text"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root),
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert any(m["grad_norm"] > 0 for m in rows[:-1]), rows
    for m in rows:
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
        assert m["weight_version"] == m["step"] and m["push/replica0_version_lag"] == 0, m
    # every version went through the delta transport (AdamW moves nearly every float32 element of the
    # tiny model each step, so here most tensors go whole: the savings are bf16's, bench/delta_push.py)
    assert all("push/delta_bytes_frac" in m for m in rows), rows
