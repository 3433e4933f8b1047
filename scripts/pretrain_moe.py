"""Pretrain a small Qwen3-MoE (or its dense twin) from scratch on the Python
sources this machine already has, and save it as a Hugging Face checkpoint.

    python scripts/pretrain_moe.py --out /tmp/moe --time-limit-s 240            # one GPU
    python scripts/pretrain_moe.py --out /tmp/dense --dense --time-limit-s 90   # the dense baseline
    python scripts/pretrain_moe.py --out /tmp/tiny --cpu-tiny --corpus DIR --steps 20

Router replay only matters where experts specialise, and no pretrained MoE can
be downloaded on the GPU machines; this makes one there, from nothing but the
``.py`` files under site-packages (``--corpus`` overrides the roots).

Data. Every ``*.py`` file (<= 1 MB) under the roots, deduplicated by real path.
A file is held out when the SHA-1 of its path *relative to its root* falls in
the lowest ``--val-frac`` of the hash range (at least one): the same split on
every machine with the same packages (:func:`split_files`; also
``bench/moe_mismatch.py --prompts-from``'s). Training files are read in hash order up to
``--max-bytes``; each file's bytes, then an end-of-text token, are concatenated
and cut into rows of ``--seq-len + 1`` tokens, visited in a seeded order.

Tokenizer. Byte level: id 0 ``<|pad|>``, 1 ``<|endoftext|>``, byte ``b`` is id
``b + 2`` (vocabulary padded to 272): code needs the newlines, tabs and
non-ASCII bytes the demo's character tokenizer lacks. An HF ``tokenizer.json``
(GPT-2's byte alphabet, no merges): AutoTokenizer, TorchTitan and the built-in
server all load it.

Model and training. The checkpoint directory is first written by
``demo_assets.write_tiny_qwen3`` (config.json in the demo's format), then the
model is TorchTitan's Qwen3 (MoE) built from that config exactly as the trainer
builds it (``hf_bridge``; on a GPU with TorchTitan's grouped expert GEMMs),
TorchTitan's init, fp32 parameters under bf16 autocast on a GPU (fp32 on CPU),
AdamW, linear warm-up then cosine decay to 10 %. The cosine's progress is the
larger of steps done / ``--steps`` and seconds spent / ``--time-limit-s``, so a
run stopped by the time limit still ends at the low learning rate; with
``--time-limit-s 0`` a run is a function of its flags and the corpus alone.
Load balancing: HF Qwen3-MoE's auxiliary loss (``qwen3_moe.aux_loss``, weight
``--aux-loss-coef``; 4 = top_k when balanced). TorchTitan's bias-based
balancing stays off: HF's model (hence every server) has no such bias.

Specialisation statistics, per MoE layer, on held-out rows (before and after
training; printed and in ``OUT/pretrain_stats.json``). ``x`` is the router's
input (the layer's normed hidden state), ``p = softmax(gate(x))`` in fp32:

* ``route_entropy``: mean over tokens of ``-sum_e p_e log p_e`` (nats; uniform
  routing is ``log E``);
* ``load_entropy``: entropy of the expert-load distribution, i.e. each
  expert's share of the tokens' top-k slots (``log E`` when balanced);
* ``load_max_share`` / ``load_min_share``: largest / smallest such share
  (``1 / E`` when balanced);
* ``noise_flip``: share of tokens whose top-k set changes when ``x`` gets
  Gaussian noise of relative size 1e-3 (``x + 1e-3 * rms(x) * N(0, 1)``, rms
  per token; only the router is rerun);
* ``bf16_flip``: share of tokens whose top-k set changes when the gate is
  computed from bf16-rounded ``x`` and weight instead of fp32;
* ``topk_margin``: median over tokens of ``p_(k) - p_(k+1)``, the probability
  gap at the top-k boundary.

At the end transformers loads the checkpoint (fp32 safetensors) and its logits
are compared with ours (fp32 both sides): the run fails above
``--max-logit-diff`` (2e-2: fp32 kernels differ by ~1e-5, but one near-tied
route taken differently moves a few logits by more).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from torchtitan_grpo.models.demo_assets import EOS, PAD, TinyQwen3, TinyQwen3Moe, write_tiny_qwen3  # noqa: E402

BYTE_OFFSET = 2  # ids 0 and 1 are the pad and end-of-text tokens
VOCAB = 272  # 258 ids, padded to a multiple of 16
MAX_FILE_BYTES = 1 << 20  # larger .py files are generated tables, not code
VAL_BYTES = 4 << 20  # held-out text read; --val-seqs rows are spread over it


class UsageError(SystemExit):
    """A bad flag or input: one line, naming it."""

    def __init__(self, msg: str):
        super().__init__(f"pretrain_moe.py: error: {msg}")


# --------------------------------------------------------------------------- #
# Tokenizer and corpus
# --------------------------------------------------------------------------- #


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the
    ``tokenizers`` ByteLevel pre-tokenizer emits)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def write_byte_tokenizer(out_dir: str) -> None:
    """Overwrite the demo's character tokenizer in ``out_dir`` with the byte one
    (same special tokens, same tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD: 0, EOS: 1}
    vocab.update({ch: b + BYTE_OFFSET for b, ch in _byte_alphabet().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    # no regex split, no prefix space: exactly one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, EOS])
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def encode_bytes(data: bytes) -> np.ndarray:
    """Token ids of raw bytes (what the tokenizer gives for their text)."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int16) + BYTE_OFFSET


def default_roots() -> list[str]:
    """site-packages (pure and platform) and torch's own directory."""
    paths = sysconfig.get_paths()
    roots = [paths["purelib"], paths["platlib"], os.path.dirname(torch.__file__)]
    return [r for i, r in enumerate(roots) if os.path.isdir(r) and r not in roots[:i]]


def list_sources(roots: list[str]) -> list[tuple[str, str]]:
    """``(path relative to its root, path)`` of every ``.py`` file of at most
    1 MB under ``roots``, each real file once (the first root finding it)."""
    seen, out = set(), []
    for root in roots:
        if not os.path.isdir(root):
            raise UsageError(f"--corpus {root}: not a directory")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    real, size = os.path.realpath(path), os.path.getsize(path)
                except OSError:
                    continue
                if real in seen or size == 0 or size > MAX_FILE_BYTES:
                    continue
                seen.add(real)
                out.append((os.path.relpath(path, root), path))
    return out


def _hash_fraction(rel: str) -> float:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:12], 16) / float(1 << 48)


def split_files(files: list[tuple[str, str]], val_frac: float) -> tuple[list[str], list[str]]:
    """(training paths, held-out paths), each in hash order. Held out: the
    files whose relative path hashes below ``val_frac``, at least one."""
    ranked = sorted(files, key=lambda f: (_hash_fraction(f[0]), f[0]))
    n_val = max(1, sum(_hash_fraction(rel) < val_frac for rel, _ in ranked))
    return [p for _, p in ranked[n_val:]], [p for _, p in ranked[:n_val]]


def read_stream(paths: list[str], max_bytes: int) -> tuple[torch.Tensor, int]:
    """Token stream (int16) of the files' bytes, each followed by EOS, until
    ``max_bytes`` are read; and the number of files read."""
    parts, total, n = [], 0, 0
    eos = np.array([1], dtype=np.int16)
    for path in paths:
        if total >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes - total)
        except OSError:
            continue
        parts += [encode_bytes(data), eos]
        total += len(data)
        n += 1
    if not parts:
        return torch.zeros(0, dtype=torch.int16), 0
    return torch.from_numpy(np.concatenate(parts)), n


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows ``[n, seq_len + 1]`` (inputs and shifted targets) of the stream,
    int16 (a quarter of int64's memory; batches are widened on the device)."""
    n = stream.numel() // (seq_len + 1)
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1)


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #


def model_shape(a: argparse.Namespace) -> TinyQwen3:
    """The HF shape of the MoE, or with ``--dense`` the dense Qwen3 whose MLP
    has the MoE's active width (top_k x expert width)."""
    common = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, head_dim=a.head_dim, vocab_size=VOCAB,
                  max_position_embeddings=max(2048, a.seq_len), seed=a.seed)
    if a.dense:
        return TinyQwen3(intermediate_size=a.top_k * a.expert_width, **common)
    return TinyQwen3Moe(intermediate_size=a.top_k * a.expert_width, num_experts=a.experts,
                        num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_width, **common)


def build(hf_dir: str, device: torch.device, max_len: int):
    """TorchTitan's model of the config in ``hf_dir``, as the trainer builds it
    (grouped expert GEMMs on a GPU), TorchTitan's random init; and its adapter."""
    from torchtitan_grpo.models import hf_bridge

    args = hf_bridge.model_args_from_hf("qwen3", hf_bridge.load_hf_config(hf_dir), max_len)
    if args.moe_enabled:
        args.moe_args.use_grouped_mm = device.type == "cuda"
    model = hf_bridge.build_model("qwen3", args, device)
    return model, hf_bridge.state_dict_adapter("qwen3", args, hf_dir)


def param_counts(model: torch.nn.Module, shape: TinyQwen3) -> tuple[int, int]:
    """(total, active per token) parameters: the unused experts' weights are
    not active."""
    total = sum(p.numel() for p in model.parameters())
    if not isinstance(shape, TinyQwen3Moe):
        return total, total
    idle = shape.num_experts - shape.num_experts_per_tok
    return total, total - shape.num_hidden_layers * idle * 3 * shape.hidden_size * shape.moe_intermediate_size


def amp(device: torch.device):
    """bf16 autocast on a GPU (the trainer's one-GPU precision); fp32 on CPU."""
    import contextlib

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def save_checkpoint(model: torch.nn.Module, adapter, out_dir: str) -> None:
    """Replace the checkpoint's weights by ``model``'s (fp32, HF names)."""
    from safetensors.torch import save_file

    from torchtitan_grpo.models import hf_bridge

    tensors = {k: v.detach().float().cpu().contiguous() for k, v in hf_bridge.hf_state_dict(model, adapter).items()}
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, f))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------- #
# Training and evaluation
# --------------------------------------------------------------------------- #


@torch.no_grad()
def val_loss(model, rows: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean next-token loss (nats per byte) over the held-out rows."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch].to(device)
        with amp(device):
            logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(),
                                                 reduction="sum")
        total, n = total + float(loss), n + chunk[:, 1:].numel()
    model.train()
    return total / max(n, 1)


def lr_at(step: int, elapsed: float, a: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then cosine to 10 % by the
    larger of the step and time progress."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(a.steps - a.warmup, 1)
    if a.time_limit_s > 0:
        progress = max(progress, elapsed / a.time_limit_s)
    return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def optimizer(model, a: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(model, train_rows: torch.Tensor, val_rows: torch.Tensor, a: argparse.Namespace,
          device: torch.device, moe: bool) -> dict:
    """The training loop; returns its history (losses, evals, steps, tokens, seconds)."""
    from torchtitan_grpo.models import qwen3_moe

    if moe and a.aux_loss_coef > 0:
        qwen3_moe.enable_aux_loss(model)
    opt = optimizer(model, a, device)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(a.seed))
    hist = {"train_loss": [], "aux_loss": [], "eval": [], "steps": 0, "tokens": 0}
    t0, cursor, step = time.perf_counter(), 0, 0
    while step < a.steps and not (a.time_limit_s > 0 and time.perf_counter() - t0 >= a.time_limit_s):
        if cursor + a.batch > len(order):  # next epoch, a new order
            order, cursor = order[torch.randperm(len(order), generator=torch.Generator().manual_seed(step))], 0
        batch = train_rows[order[cursor : cursor + a.batch]].to(device).long()
        cursor += a.batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step, time.perf_counter() - t0, a)
        with amp(device):
            logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        aux = torch.zeros((), device=device)
        if moe and a.aux_loss_coef > 0:
            aux = qwen3_moe.aux_loss(model, torch.ones_like(batch[:, :-1], dtype=torch.bool))
        (loss + a.aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        hist["tokens"] += batch[:, 1:].numel()
        if step == 1 or step % a.log_every == 0:  # a host sync: not every step
            hist["train_loss"].append((step, loss.item()))
            hist["aux_loss"].append((step, aux.item()))
        if step % a.eval_every == 0:
            _log_eval(model, val_rows, a, device, hist, step, loss.item(), aux.item(), time.perf_counter() - t0)
    hist["steps"], hist["seconds"] = step, time.perf_counter() - t0
    if moe and a.aux_loss_coef > 0:
        qwen3_moe.enable_aux_loss(model, False)
    return hist


def _log_eval(model, val_rows, a, device, hist: dict, step: int, loss: float, aux: float, elapsed: float) -> None:
    v = val_loss(model, val_rows, a.batch, device)
    hist["eval"].append({"step": step, "val_loss": v, "train_loss": loss, "seconds": elapsed})
    print(f"step {step:5d} | loss {loss:.4f} | aux {aux:.3f} | val {v:.4f} | "
          f"{hist['tokens'] / max(elapsed, 1e-9) / 1e3:7.1f}k tok/s | {elapsed:6.1f} s", flush=True)


# --------------------------------------------------------------------------- #
# Routing statistics and the transformers check
# --------------------------------------------------------------------------- #


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def _topk_set(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.topk(k, dim=-1).indices.sort(-1).values


def layer_stats(x: torch.Tensor, weight: torch.Tensor, k: int, noise: float, gen: torch.Generator) -> dict:
    """The module docstring's figures for one router: input ``x [N, dim]``,
    gate weight ``[E, dim]``."""
    x, w = x.float(), weight.float()
    logits = x @ w.t()
    p = logits.softmax(-1)
    picked = _topk_set(logits, k)
    load = torch.bincount(picked.flatten(), minlength=w.shape[0]).float()
    load = load / load.sum()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    eps = torch.randn(x.shape, generator=gen, device="cpu").to(x.device)
    noisy = _topk_set((x + noise * rms * eps) @ w.t(), k)
    low = _topk_set((x.bfloat16() @ w.bfloat16().t()).float(), k)
    top = p.topk(k + 1, dim=-1).values if k < w.shape[0] else None
    return {"route_entropy": float(_entropy(p).mean()), "load_entropy": float(_entropy(load)),
            "load_max_share": float(load.max()), "load_min_share": float(load.min()),
            "noise_flip": float((noisy != picked).any(-1).float().mean()),
            "bf16_flip": float((low != picked).any(-1).float().mean()),
            "topk_margin": float((top[:, k - 1] - top[:, k]).median()) if top is not None else float("nan")}


@torch.no_grad()
def routing_stats(model, rows: torch.Tensor, device: torch.device, noise: float, seed: int) -> dict | None:
    """Per-layer routing figures on ``rows`` (held out), their means, and the
    uniform-routing entropy; None for a dense model."""
    from torchtitan_grpo.models.router_replay import moe_routers

    routers = moe_routers(model)
    if not routers:
        return None
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer, _ in routers}
    hooks = [router.register_forward_pre_hook(lambda _m, args, layer=layer: seen[layer].append(args[0].detach()))
             for layer, router in routers]
    try:
        model.eval()
        for i in range(0, len(rows), 8):
            with amp(device):
                model(rows[i : i + 8, :-1].to(device))
        model.train()
    finally:
        for h in hooks:
            h.remove()
    gen = torch.Generator().manual_seed(seed)
    layers = [{"layer": layer, **layer_stats(torch.cat(seen[layer]), router.gate.weight, router.top_k, noise, gen)}
              for layer, router in routers]
    keys = [k for k in layers[0] if k != "layer"]
    return {"layers": layers, "mean": {k: sum(r[k] for r in layers) / len(layers) for k in keys},
            "uniform_entropy": math.log(routers[0][1].num_experts), "noise": noise,
            "tokens": int(sum(t.shape[0] for t in seen[routers[0][0]]))}


@torch.no_grad()
def transformers_diff(model, out_dir: str, rows: torch.Tensor, device: torch.device) -> float:
    """Max abs logit diff of transformers' load of the checkpoint against ours,
    fp32 on both sides (our experts through the exact per-expert loop)."""
    from torchtitan.models.moe.moe import GroupedExperts
    from transformers import AutoModelForCausalLM

    try:  # HF's eager experts: its default grouped GEMM may not take fp32
        hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, experts_implementation="eager")
    except (TypeError, ValueError):  # a transformers without the choice
        hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    hf = hf.to(device).eval()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    grouped = [m.use_grouped_mm for m in experts]
    for m in experts:
        m.use_grouped_mm = False  # the grouped GEMMs run in bf16 whatever the weights
    model.eval()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: a format check, not a precision one
    try:
        tokens = rows[:, :-1].to(device)
        ours = model(tokens).float()
        theirs = hf(tokens).logits.float()
    finally:
        torch.set_float32_matmul_precision(precision)
        for m, g in zip(experts, grouped):
            m.use_grouped_mm = g
        model.train()
    del hf
    return float((ours - theirs).abs().max())


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, expert_width=32,
            seq_len=64, batch=8, steps=30, warmup=3, eval_every=10, log_every=5, val_seqs=8, device="cpu",
            max_bytes=2_000_000, lr=3e-3)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--out", required=True, metavar="DIR", help="checkpoint directory (config.json, safetensors, tokenizer)")
    add("--corpus", action="append", metavar="DIR", help="corpus root (repeatable); default: site-packages, torch")
    add("--dense", action="store_true", help="the dense Qwen3 of the same active size instead of the MoE")
    add("--cpu-tiny", action="store_true", help="a tiny shape on CPU, a few steps (the tests)")
    add("--layers", type=int, default=8)
    add("--hidden", type=int, default=512)
    add("--heads", type=int, default=8)
    add("--kv-heads", type=int, default=4)
    add("--head-dim", type=int, default=64)
    add("--experts", type=int, default=32)
    add("--top-k", type=int, default=4)
    add("--expert-width", type=int, default=384, help="expert MLP width; the dense MLP is top_k x this")
    add("--steps", type=int, default=100_000, help="step cap (the time limit usually stops first)")
    add("--time-limit-s", type=float, default=240.0, help="training-loop seconds (0: none)")
    add("--seq-len", type=int, default=512)
    add("--batch", type=int, default=64)
    add("--lr", type=float, default=2e-3)
    add("--warmup", type=int, default=100)
    add("--weight-decay", type=float, default=0.1)
    add("--aux-loss-coef", type=float, default=0.01, help="load-balancing loss weight (MoE)")
    add("--max-bytes", type=int, default=200_000_000, help="training text read, at most")
    add("--val-frac", type=float, default=0.02, help="share of files held out (by path hash)")
    add("--val-seqs", type=int, default=64, help="held-out rows for the loss and the routing figures")
    add("--eval-every", type=int, default=100)
    add("--log-every", type=int, default=10)
    add("--noise", type=float, default=1e-3, help="relative input noise of the flip statistic")
    add("--max-logit-diff", type=float, default=2e-2, help="fail above this transformers-vs-ours diff (fp32)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.cpu_tiny:  # the tiny shape, unless a flag was given explicitly
        given = {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in (argv or sys.argv[1:])}
        for key, value in TINY.items():
            if key not in given:
                setattr(a, key, value)
        a.time_limit_s = a.time_limit_s if "time_limit_s" in given else 0.0
    check(a)
    return a


def check(a: argparse.Namespace) -> None:
    """One-line errors naming the flag."""
    for flag in ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_width",
                 "steps", "seq_len", "batch", "warmup", "max_bytes", "val_seqs", "eval_every", "log_every"):
        if getattr(a, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.top_k > a.experts:
        raise UsageError(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    if a.heads % a.kv_heads:
        raise UsageError(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if not 0 < a.val_frac < 1:
        raise UsageError(f"--val-frac must be in (0, 1), got {a.val_frac}")
    if a.lr <= 0 or a.time_limit_s < 0 or a.aux_loss_coef < 0:
        raise UsageError("--lr must be > 0, --time-limit-s and --aux-loss-coef >= 0")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: no GPU here (use --device cpu)")


def load_data(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(training rows, held-out rows, what was read)."""
    t0 = time.perf_counter()
    roots = a.corpus or default_roots()
    files = list_sources(roots)
    if len(files) < 2:
        raise UsageError(f"--corpus {' '.join(roots)}: {len(files)} .py file(s); need >= 2 (train and held out)")
    train_paths, val_paths = split_files(files, a.val_frac)
    stream, n_train = read_stream(train_paths, a.max_bytes)
    val_stream, n_val = read_stream(val_paths, VAL_BYTES)
    train_rows, val_rows = pack(stream, a.seq_len), pack(val_stream, a.seq_len)
    # rows spread over everything read: many held-out files, not the first few
    val_rows = val_rows[torch.linspace(0, len(val_rows) - 1, min(a.val_seqs, len(val_rows))).long()].long()
    if len(train_rows) < a.batch or len(val_rows) < 1:
        raise UsageError(f"--corpus {' '.join(roots)}: {stream.numel()} training / {val_stream.numel()} held-out "
                         f"tokens, too few for --batch {a.batch} x --seq-len {a.seq_len}")
    info = {"roots": roots, "files": len(files), "train_files_read": n_train, "val_files": len(val_paths),
            "val_files_read": n_val, "train_tokens": int(stream.numel()), "val_rows": len(val_rows),
            "read_s": round(time.perf_counter() - t0, 2)}
    print(f"corpus: {len(files)} files under {', '.join(roots)}; {n_train} training files read "
          f"({stream.numel() / 1e6:.1f} M tokens, {len(train_rows)} rows of {a.seq_len + 1}), "
          f"{len(val_paths)} held out ({len(val_rows)} rows); {info['read_s']} s", flush=True)
    return train_rows, val_rows, info


def _print_routing(before: dict, after: dict) -> None:
    keys = list(before["mean"])
    print(f"routing on held-out rows ({after['tokens']} tokens; uniform entropy {after['uniform_entropy']:.3f}), "
          "before -> after:")
    print("| layer | " + " | ".join(keys) + " |")
    print("|---:|" + "---:|" * len(keys))
    for b, f in zip(before["layers"], after["layers"]):
        print(f"| {b['layer']} | " + " | ".join(f"{b[k]:.4f} -> {f[k]:.4f}" for k in keys) + " |")
    print("| mean | " + " | ".join(f"{before['mean'][k]:.4f} -> {after['mean'][k]:.4f}" for k in keys) + " |")


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    train_rows, val_rows, data = load_data(a)
    shape = model_shape(a)
    write_tiny_qwen3(a.out, shape)  # config.json in the demo's format (its random weights are replaced)
    write_byte_tokenizer(a.out)
    torch.manual_seed(a.seed)
    model, adapter = build(a.out, device, max(a.seq_len, 256))
    moe = isinstance(shape, TinyQwen3Moe)
    total, active = param_counts(model, shape)
    print(f"{'Qwen3-MoE' if moe else 'dense Qwen3'}: {total / 1e6:.1f} M parameters, {active / 1e6:.1f} M active; "
          f"{a.device}, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}", flush=True)
    before_loss = val_loss(model, val_rows, a.batch, device)
    before = routing_stats(model, val_rows, device, a.noise, a.seed)
    print(f"step     0 | val {before_loss:.4f}", flush=True)
    hist = train(model, train_rows, val_rows, a, device, moe)
    after_loss = val_loss(model, val_rows, a.batch, device)
    after = routing_stats(model, val_rows, device, a.noise, a.seed)
    save_checkpoint(model, adapter, a.out)
    diff = transformers_diff(model, a.out, val_rows[:2], device)
    print(f"trained {hist['steps']} steps, {hist['tokens'] / 1e6:.1f} M tokens in {hist['seconds']:.0f} s; "
          f"held-out loss {before_loss:.4f} -> {after_loss:.4f} nats/byte")
    if moe:
        _print_routing(before, after)
    ok = diff <= a.max_logit_diff
    print(f"transformers vs ours, fp32 logits: max abs diff {diff:.2e} ({'ok' if ok else 'FAIL'}, "
          f"limit {a.max_logit_diff:g}); checkpoint {a.out}")
    stats = {"model": "moe" if moe else "dense", "shape": asdict(shape), "params_total": total,
             "params_active": active, "device": a.device, "data": data,
             "train": {k: hist[k] for k in ("steps", "tokens", "seconds", "train_loss", "aux_loss", "eval")},
             "flags": {k: v for k, v in vars(a).items() if k not in ("corpus",)},
             "balancing": f"HF Qwen3-MoE aux loss x {a.aux_loss_coef}" if moe else None,
             "val_loss_before": before_loss, "val_loss_after": after_loss, "transformers_max_abs_diff": diff,
             "routing_before": before, "routing_after": after}
    with open(os.path.join(a.out, "pretrain_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    if not ok:
        raise SystemExit(f"pretrain_moe.py: transformers' logits differ from ours by {diff:.2e} "
                         f"(--max-logit-diff {a.max_logit_diff:g})")
    return stats


if __name__ == "__main__":
    main()
