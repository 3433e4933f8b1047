"""MoE router replay: how far the trainer's log-probs are from the rollout's,
with replay off and on, and what a pushed version of an MoE model costs.

    python bench/moe_mismatch.py --shape 30b-a3b --layers 4 --device cuda:0 --server-device cuda:1
    python bench/moe_mismatch.py --cpu      # a tiny MoE on CPU (what the tests run)

1. A Qwen3-MoE of the shape (30B-A3B's width: hidden 2048, 128 experts, top 8,
   expert width 768; ``--layers`` decoder layers) with random weights is
   written once, then trained for ``--train-steps`` next-token steps on a
   synthetic corpus (a fixed random bigram chain over 1,000 token ids), so the
   routers are no longer near-uniform: random routers pick by near-ties,
   which exaggerates flips.
2. A built-in server (its own process, ``--server-device``, bf16, static KV
   cache and CUDA graphs on a GPU, ``--enable-return-routed-experts``) samples
   ``--samples`` completions of ``--new-tokens`` at temperature 1 from corpus
   prompts, with their log-probs and routed experts (SGLang's /generate).
3. The trainer's model (fp32 weights, bf16 autocast on a GPU: the one-GPU
   trainer's precision) scores the same tokens with ``grpo.router_replay``
   off and on. Per completion token: |trainer - rollout| log-prob (mean, max)
   and the k3 estimate of KL(rollout || trainer); and the share of
   (token, layer) expert sets the trainer's own router picks differently.
4. Full pushes of the trained weights to the server (bf16, SGLang protocol,
   NCCL on GPUs, gloo on CPU): seconds per version and GB/s, tensor count.

A given checkpoint instead (``--model DIR``: a Qwen3-MoE, or a dense Qwen3 as
the baseline, e.g. from ``scripts/pretrain_moe.py``) skips step 1 and is left
as it is; the prompts are then the first ``--prompt-tokens`` tokens of
held-out source files (``--prompts-from`` roots, default site-packages: the
held-out split of ``scripts/pretrain_moe.py``). A dense model is scored with
replay off only. Per completion token besides the above: the share of tokens
with |dlogp| > 0.5 and > 1.0 ("extreme"), and the share whose routed expert
set (as the trainer used it) differs from the server's in at least one layer.
The figures also go to ``WORK/mismatch.json``.

    python bench/moe_mismatch.py --model /tmp/moe --device cuda:0 --server-device cuda:0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
import torch  # noqa: E402

from torchtitan_grpo.models.demo_assets import TinyQwen3Moe  # noqa: E402

SHAPES = {
    "tiny": TinyQwen3Moe(),
    # Qwen3-30B-A3B's config.json, but for the layer count (--layers)
    "30b-a3b": TinyQwen3Moe(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            intermediate_size=6144, vocab_size=151936, max_position_embeddings=4096,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
}
CORPUS_VOCAB = 1000


def corpus(n: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    """``[n, length]`` token ids of a fixed random bigram chain over ids 2..vocab+1
    (each id has 4 likely successors): learnable, so training shapes the routers."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(2, vocab + 2, (vocab + 2, 4), generator=g)
    g.manual_seed(seed)
    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = torch.randint(2, vocab + 2, (n,), generator=g)
    for t in range(1, length):
        pick = torch.randint(0, 4, (n,), generator=g)
        out[:, t] = successors[out[:, t - 1], pick]
    return out


def write_model(shape: TinyQwen3Moe, layers: int, out: str, device: torch.device) -> str:
    """A random Qwen3-MoE checkpoint (float32 on CPU runs, bf16 otherwise), once."""
    from dataclasses import asdict, replace

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from torchtitan_grpo.models.demo_assets import write_tokenizer

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    fields = asdict(replace(shape, num_hidden_layers=layers))
    fields.pop("seed")
    cfg = Qwen3MoeConfig(**fields, bos_token_id=None, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6,
                         attention_bias=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    if device.type != "cpu":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out + ".tmp", safe_serialization=True)
    write_tokenizer(out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def build_trainer_model(hf_dir: str, device: torch.device, max_len: int):
    from torchtitan_grpo.models import hf_bridge as tm

    hf_config = tm.load_hf_config(hf_dir)
    args = tm.model_args_from_hf("qwen3", hf_config, max_len)
    # grouped GEMMs for the experts on a GPU (TorchTitan's bf16 path); CPU keeps the fp32 loop
    args.moe_args.use_grouped_mm = device.type == "cuda"
    model = tm.build_model("qwen3", args, device)
    adapter = tm.state_dict_adapter("qwen3", args, hf_dir)
    tm.load_hf_weights(model, adapter, hf_dir)
    return model, adapter


def amp(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def train(model, device: torch.device, steps: int, batch: int, length: int, vocab: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    losses = []
    for step in range(steps):
        tokens = corpus(batch, length, seed=step, vocab=vocab).to(device)
        with amp(device):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    del opt
    return losses


def save_hf(model, adapter, hf_dir: str, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    from torchtitan_grpo.models import hf_bridge as tm

    tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in tm.hf_state_dict(model, adapter).items()}
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(hf_dir, f))
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})


def generate(url: str, prompts: list[list[int]], new_tokens: int, layers: int, top_k: int):
    """Samples with rollout log-probs and routed experts (SGLang's /generate, one
    batch); ``top_k`` 0: a dense model, no routes asked for."""
    from torchtitan_grpo.protocol import route_codec
    from torchtitan_grpo.train.sample import Sample

    body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": top_k > 0,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    samples = []
    for prompt, item in zip(prompts, out):
        meta = item["meta_info"]
        routes = (route_codec.decode_sglang(meta["routed_experts"], layers, top_k, url, "meta_info.routed_experts")
                  if top_k else None)
        lps = [float(x[0]) for x in meta["output_token_logprobs"]]
        samples.append(Sample(list(prompt), list(item["output_ids"]), lps, 0.0, 0.0, "length", [],
                              routed_experts=routes))
    return samples


@torch.no_grad()
def score(model, samples, device: torch.device, replay_on: bool, micro: int,
          flipped: list[torch.Tensor] | None = None) -> dict:
    """Mismatch of the trainer's log-probs against the rollout's over completion
    tokens; ``flipped`` (per sample, per completion token: the position feeding
    it routed differently in some layer with replay off) also restricts it to
    those tokens. Returns the flags it saw (meaningful with replay off)."""
    from torchtitan_grpo.models import router_replay

    routers = router_replay.moe_routers(model)
    diffs, k3s, flags, flips, slots = [], [], [], 0, 0
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        T = max(len(s.prompt_ids) + len(s.completion_ids) for s in chunk)
        tokens = torch.zeros(len(chunk), T, dtype=torch.long)
        for r, s in enumerate(chunk):
            seq = s.prompt_ids + s.completion_ids
            tokens[r, : len(seq)] = torch.tensor(seq)
        tokens = tokens.to(device)
        routes = router_replay.routes_tensor(chunk, length=T)
        for _, router in routers:
            router.keep_stats = True
        with amp(device), router_replay.replay(model, routes if replay_on else None):
            logits = model(tokens)
        logp = torch.log_softmax(logits.float(), dim=-1)
        # where the trainer's own expert sets differ from the rollout's, any layer: [rows, T]
        differs = torch.zeros(len(chunk), T, dtype=torch.bool, device=device)
        given = routes.to(device).long() if routes is not None else None
        for layer, router in routers if given is not None else []:
            _, picked = router.last_stats
            picked = picked.reshape(len(chunk), T, -1).sort(-1).values
            layer_differs = (picked != given[:, :, layer].sort(-1).values).any(-1) & (given[:, :, layer, 0] >= 0)
            differs |= layer_differs
            flips += int(layer_differs.sum())
            slots += int((given[:, :, layer, 0] >= 0).sum())
        for _, router in routers:
            router.keep_stats, router.last_stats = False, None
        for r, s in enumerate(chunk):
            P, C = len(s.prompt_ids), len(s.completion_ids)
            got = logp[r, P - 1 : P + C - 1].gather(-1, tokens[r, P : P + C, None]).squeeze(-1)
            d = got - torch.tensor(s.rollout_logprobs, device=device)
            diffs.append(d.abs())
            k3s.append(torch.exp(d) - 1 - d)  # log(pi_train / pi_rollout) on rollout samples
            flags.append(differs[r, P - 1 : P + C - 1].clone())
    d, k3 = torch.cat(diffs), torch.cat(k3s)
    on = torch.cat(flipped if flipped is not None else flags)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "k3": float(k3.mean()),
            "extreme_05": float((d > 0.5).float().mean()), "extreme_1": float((d > 1.0).float().mean()),
            "tokens_differ": float(torch.cat(flags).float().mean()),
            "route_flips": flips / max(slots, 1), "flagged": flags, "flipped_tokens": float(on.float().mean()),
            "flipped_mean_abs": float(d[on].mean()) if on.any() else float("nan"),
            "steady_mean_abs": float(d[~on].mean()) if (~on).any() else float("nan")}


def time_pushes(url: str, model, adapter, device: torch.device, server_device: str,
                reps: int) -> tuple[int, int, list[float]]:
    from torchtitan_grpo.models import hf_bridge as tm
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    backend = "gloo" if device.type != "cuda" else "nccl" if str(device) != server_device else "ipc"  # one GPU: ipc
    cfg = PushConfig(mode="sync", backend=backend, protocol="sglang",
                     dtype=torch.bfloat16, bucket_bytes=1 << 30, deadline_s=600, master_address="127.0.0.1")
    tensors = tm.hf_state_dict(model, adapter)
    loop = LoopThread()
    pusher = Pusher(loop, [url], cfg, device)
    times = []
    try:
        pusher.connect(initial_version=0)
        for v in range(1, reps + 2):
            t0 = time.perf_counter()
            pusher.push(tensors, v, wait=True)
            times.append(time.perf_counter() - t0)
            if not pusher.status()[0]["admitted"]:
                raise RuntimeError(f"replica ejected: {pusher.status()[0]['last_error']}")
        return pusher.bytes_per_version, len(tensors), times[1:]
    finally:
        pusher.close()
        loop.close()


def code_prompts(hf_dir: str, roots: list[str] | None, n: int, length: int, val_frac: float) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the start of each held-out source file
    (``scripts/pretrain_moe.py``'s split of ``roots``) long enough, cycled
    when fewer files than ``n`` qualify, tokenized by the model's tokenizer."""
    from transformers import AutoTokenizer

    from scripts.pretrain_moe import default_roots, list_sources, split_files

    tok = AutoTokenizer.from_pretrained(hf_dir)
    held_out = split_files(list_sources(roots or default_roots()), val_frac)[1]
    prompts = []
    for path in held_out:
        with open(path, "rb") as f:
            text = f.read(8 * length).decode("utf-8", errors="replace")  # >= length tokens of any tokenizer
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    if not prompts:
        raise SystemExit(f"moe_mismatch.py: error: --prompts-from: no held-out file has {length} tokens")
    return [prompts[i % len(prompts)] for i in range(n)]


def given_model(hf_dir: str) -> tuple[bool, int, int]:
    """(is MoE, layers, top_k) of the checkpoint ``--model`` names."""
    from torchtitan_grpo.models import hf_bridge, qwen3_moe

    try:
        cfg = hf_bridge.load_hf_config(hf_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"moe_mismatch.py: error: --model {hf_dir}: {e}")
    moe = qwen3_moe.is_moe_config(cfg)
    return moe, int(cfg["num_hidden_layers"]), int(cfg.get("num_experts_per_tok", 0)) if moe else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--server-device", default="cuda:1")
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="timed pushes (after one untimed); 0: no push")
    p.add_argument("--work", default="outputs/bench_moe_mismatch")
    p.add_argument("--cpu", action="store_true", help="the tiny MoE on CPU")
    p.add_argument("--model", metavar="DIR", help="an HF Qwen3-MoE or dense Qwen3 checkpoint instead of random "
                   "weights (no LM steps; the directory is not written)")
    p.add_argument("--prompts-from", nargs="*", metavar="DIR", help="prompts from held-out .py files under these "
                   "roots (no DIR: site-packages; the default with --model)")
    p.add_argument("--val-frac", type=float, default=0.02, help="held-out share, as scripts/pretrain_moe.py's")
    a = p.parse_args(argv)
    if a.cpu:
        a.shape, a.layers, a.device, a.server_device = "tiny", 2, "cpu", "cpu"
        a.train_steps, a.samples, a.prompt_tokens, a.new_tokens, a.reps = 20, 4, 8, 8, 1
    if a.model and a.prompts_from is None:
        a.prompts_from = []
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    from tests.server_procs import start_server, stop_server
    from pathlib import Path

    device = torch.device(a.device)
    max_len = a.prompt_tokens + a.new_tokens + 8
    losses, train_s = [], 0.0
    if a.model:
        hf_dir = a.model
        moe, a.layers, top_k = given_model(hf_dir)
        model, adapter = build_trainer_model(hf_dir, device, max(max_len, 256))
        name = f"{'Qwen3-MoE' if moe else 'dense Qwen3'} {hf_dir} ({a.layers} layers)"
    else:
        shape = SHAPES[a.shape]
        moe, top_k = True, shape.num_experts_per_tok
        vocab = min(CORPUS_VOCAB, shape.vocab_size - 2)  # ids 2 .. vocab + 1
        hf_dir = write_model(shape, a.layers, os.path.join(a.work, f"{a.shape}-{a.layers}l"), device)
        t0 = time.perf_counter()
        model, adapter = build_trainer_model(hf_dir, device, max(max_len, 256))
        losses = train(model, device, a.train_steps, 8, 256 if not a.cpu else 32, vocab) if a.train_steps else []
        train_s = time.perf_counter() - t0
        save_hf(model, adapter, hf_dir, torch.float32 if a.cpu else torch.bfloat16)
        name = f"Qwen3-MoE {a.shape} x {a.layers} layers"
    if a.prompts_from is not None:
        prompts = code_prompts(hf_dir, a.prompts_from, a.samples, a.prompt_tokens, a.val_frac)
    else:
        prompts = corpus(a.samples, a.prompt_tokens, seed=10_000, vocab=vocab).tolist()

    os.makedirs(a.work, exist_ok=True)
    log = Path(a.work) / "server.log"
    args = ["--device", a.server_device, "--dtype", "float32" if a.server_device == "cpu" else "bfloat16",
            "--max-batch-size", str(a.samples), "--max-model-len", str(max_len), "--weight-group-timeout", "600"]
    proc, url = start_server(hf_dir, log, *args, *(["--enable-return-routed-experts"] if moe else []), timeout=900)
    try:
        t1 = time.perf_counter()
        samples = generate(url, prompts, a.new_tokens, a.layers, top_k)
        gen_s = time.perf_counter() - t1
        micro = 8 if not a.cpu else 4
        off = score(model, samples, device, False, micro)
        on = score(model, samples, device, True, micro, flipped=off["flagged"]) if moe else None
        pushed = time_pushes(url, model, adapter, device, a.server_device, a.reps) if a.reps else None
    finally:
        stop_server(proc, log)
    n_params = sum(p.numel() for p in model.parameters())
    trained = (f"{a.train_steps} LM steps (loss {losses[0] if losses else float('nan'):.2f} -> "
               f"{losses[-1] if losses else float('nan'):.2f}, {train_s:.0f} s); " if not a.model else "")
    print(f"{name} ({n_params / 1e9:.2f} B parameters), trainer {a.device} "
          f"({'bf16 autocast' if device.type == 'cuda' else 'fp32'}), server {a.server_device}; {trained}"
          f"{len(samples)} samples x {a.new_tokens} tokens at temperature 1 in {gen_s:.1f} s")
    report(off, on)
    result = {"off": off, "on": on}
    if pushed is not None:
        nbytes, ntensors, times = pushed
        push_s = statistics.median(times)
        transport = "gloo" if device.type != "cuda" else "nccl" if a.device != a.server_device else "ipc"
        print(f"push ({transport}): {ntensors} tensors, {nbytes / 1e9:.2f} GB per version (bf16), median "
              f"{push_s:.3f} s = {nbytes / push_s / 1e9:.1f} GB/s ({a.reps} timed)")
        result.update(push_s=push_s, bytes=nbytes, tensors=ntensors)
    for r in (off, on):
        if r is not None:
            r.pop("flagged")
    with open(os.path.join(a.work, "mismatch.json"), "w") as f:
        json.dump({"model": hf_dir, "samples": len(samples), "new_tokens": a.new_tokens, **result}, f, indent=1)
    return result


def _ratio(off: dict, on: dict, key: str) -> float:
    return off[key] / on[key] if on[key] > 0 else float("nan")


def report(off: dict, on: dict | None) -> None:
    """The table: one row per replay mode (a dense model: off only)."""
    if on is not None:
        print(f"tokens whose input position routes differently (replay off, any layer): {off['flipped_tokens']:.4f}")
    print("| router replay | mean abs logprob diff | max abs | k3 KL | trainer routes differing | "
          "mean abs, those tokens | mean abs, the others | share abs > 0.5 | share abs > 1.0 | "
          "tokens routed differently |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in (("off", off), ("rollout", on)):
        if r is not None:
            print(f"| {name} | {r['mean_abs']:.5f} | {r['max_abs']:.4f} | {r['k3']:.2e} | {r['route_flips']:.4f} | "
                  f"{r['flipped_mean_abs']:.5f} | {r['steady_mean_abs']:.5f} | {r['extreme_05']:.2e} | "
                  f"{r['extreme_1']:.2e} | {r['tokens_differ']:.4f} |")
    if on is not None:
        print(f"mean abs ratio off / on: {_ratio(off, on, 'mean_abs'):.2f}; k3 ratio: "
              f"{_ratio(off, on, 'k3'):.2f}")


if __name__ == "__main__":
    main()
