"""Chunked log-probs (torchtitan_grpo.train.token_logprobs) against the full-logits
path: the function, every GRPO loss variant and IS mode built on it, its
memory bound, one train_step with the head wired into the model, and one
2-rank launch (FSDP2 with tied embeddings, DDP) where FSDP's and DDP's hooks
run around the head."""

import itertools
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_grpo.train import loss as grpo_losses
from torchtitan_grpo.train.token_logprobs import chunked_logprobs, logprob_head
from torchtitan_grpo.train.trainer import Sample, _LossContext, _logprob_loss, _micro_batch_loss

from tests.conftest import ROOT

DEMO = f"{ROOT}/train_configs/demo_cpu.toml"
B, T, DIM, V = 3, 29, 16, 50  # B * T = 87 tokens: chunks of 7 and 11 leave a remainder


def _inputs(dtype=torch.float32, dim=DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, dim, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, dim, generator=g, dtype=dtype) / math.sqrt(dim)).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    return h, w, targets


def _direct(h, w, targets, temperature):
    """Per-token log-probs and entropy written out on full logits."""
    z = h @ w.t()
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk", [1, 7, 11, 1000])
def test_logprobs_entropy_and_gradients_match_full_logits(dtype, tol, temperature, chunk):
    h, w, targets = _inputs(dtype)
    lp, ent = chunked_logprobs(h, w, targets, temperature, chunk, with_entropy=True)
    ref_lp, ref_ent = _direct(h, w, targets, temperature)
    assert lp.dtype == torch.promote_types(dtype, torch.float32) and lp.shape == targets.shape and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=tol)
    # gradient of an arbitrary weighted sum, w.r.t. hidden states and weight
    g = torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=dtype)
    grads = torch.autograd.grad((lp * g).sum(), (h, w))
    ref_grads = torch.autograd.grad((ref_lp * g).sum(), (h, w))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=tol * 10, rtol=tol * 10)


def test_matches_the_loss_modules_token_logprobs():
    h, w, targets = _inputs()
    lp, ent = chunked_logprobs(h.detach(), w.detach(), targets, 0.7, 7)
    assert ent is None
    torch.testing.assert_close(lp, grpo_losses.token_logprobs(h.detach() @ w.detach().t(), targets, 0.7),
                               atol=1e-6, rtol=0)


def _ctx(loss_agg, is_correction, kl_coef):
    g = SimpleNamespace(is_correction=is_correction, is_cap=1.5, clip_low=0.2, clip_high=0.28, loss_agg=loss_agg,
                        kl_coef=kl_coef, kl_estimator="k3")
    return _LossContext(g, 0.7, T, 5, 60.0)


@pytest.mark.parametrize("loss_agg,is_correction,kl_coef", list(itertools.product(
    grpo_losses.LOSS_AGGREGATIONS, ["none", "token", "sequence"], [0.0, 0.3])))
def test_every_loss_variant_matches_the_full_logits_path(loss_agg, is_correction, kl_coef):
    """The trainer's loss from chunked log-probs (``_logprob_loss``) equals the
    loss from full logits (``_micro_batch_loss``): value, metrics, gradients."""
    g = torch.Generator().manual_seed(2)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0.0  # a row without trained tokens (padding)
    old = -math.log(V) + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.0])
    ref = -math.log(V) + 0.3 * torch.randn(B, T, generator=g) if kl_coef else None
    ctx = _ctx(loss_agg, is_correction, kl_coef)

    h, w, targets = _inputs()
    full_loss, full_rec = _micro_batch_loss((h @ w.t()).float(), targets, mask, old, adv, ctx, ref)
    full_grads = torch.autograd.grad(full_loss, (h, w))

    lp, ent = chunked_logprobs(h, w, targets, ctx.temperature, 11, with_entropy=True)
    entropy = (ent * mask).sum() / mask.sum().clamp(min=1.0)
    loss, rec = _logprob_loss(lp, entropy, mask, old, adv, ctx, ref)
    grads = torch.autograd.grad(loss, (h, w))

    assert abs(loss.item() - full_loss.item()) <= 1e-6 and full_loss.item() != 0.0
    for key in ("clip_fraction", "tokens", "lp_diff_max", "entropy"):
        assert rec[key] == pytest.approx(full_rec[key], abs=1e-5), key
    for got, want in zip(grads, full_grads):
        assert float(want.abs().max()) > 0
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_grows_past_one_chunk_of_logits():
    # dim 4: the weight and the hidden states (and their gradients) stay below
    # one chunk of logits, so any [tokens, V] tensor would show
    h, w, targets = _inputs(dim=4)
    chunk = 7
    with _LargestOutput() as seen:
        lp, _ = chunked_logprobs(h, w, targets, 0.7, chunk, with_entropy=True)
        lp.sum().backward()
    assert seen.largest <= chunk * V < B * T * V
    with _LargestOutput() as full:
        grpo_losses.token_logprobs(h @ w.t(), targets, 0.7).sum().backward()
    assert full.largest >= B * T * V  # the measure sees the full path's logits


def test_under_autocast_it_computes_like_the_linear_layer():
    """One GPU / DDP run the forward in autocast (CPU autocast stands in): the
    chunks' matmuls run in bfloat16 like F.linear there, gradients come back in
    the parameters' float32."""
    h, w, targets = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_logprobs(h, w, targets, 1.0, 7)
        logits = torch.nn.functional.linear(h, w)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(lp, grpo_losses.token_logprobs(logits.float(), targets), atol=1e-5, rtol=0)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    want_h, want_w = torch.autograd.grad(grpo_losses.token_logprobs(logits.float(), targets).sum(), (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(gh, want_h, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw, want_w, atol=2e-2, rtol=2e-2)
    lp32, _ = chunked_logprobs(h, w, targets, 1.0, 7)
    assert not torch.equal(lp, lp32)  # bfloat16 really was used


def test_bad_arguments_are_named():
    h, w, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(h, w, targets, 1.0, 0)
    with pytest.raises(ValueError, match="align"):
        chunked_logprobs(h, w, targets[:, 1:], 1.0, 4)


def test_head_replaces_the_output_forward_only_while_active():
    out = torch.nn.Linear(DIM, V, bias=False)
    h, _, targets = _inputs()
    calls = []
    out.register_forward_hook(lambda m, a, o: calls.append(o.shape))
    with logprob_head(out, targets[:, :-1], 0.7, 5, with_entropy=True) as head:
        lp = out(h)
    want_lp, want_ent = _direct(h, out.weight, targets, 0.7)
    torch.testing.assert_close(lp, want_lp[:, :-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(head.entropy, want_ent[:, :-1], atol=1e-6, rtol=1e-6)
    assert out(h).shape == (B, T, V)  # the plain layer again
    assert calls == [(B, T - 1), (B, T, V)]  # the module's hooks ran around the head
    with pytest.raises(ValueError, match="bias"):
        with logprob_head(torch.nn.Linear(DIM, V), targets, 1.0, 5):
            pass


# ------------------------------------------------------------ train_step


def _batch():
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(5):
        n = 2 + i
        ids = torch.randint(2, 97, (3 + n,), generator=g).tolist()
        old = (-math.log(128) + 0.5 * torch.randn(n, generator=g)).tolist()
        out.append(Sample(ids[:3], ids[3:], old, (-1.0) ** i, 0.0, "stop", ["0"]))
    return out


def test_train_step_chunked_matches_full_logits(tiny_model_dir):
    """One GRPO step (2 micro-batches, KL reference, temperature 0.7) with the
    chunked head (5 tokens a chunk: no micro-batch divides evenly) gives the
    full-logits step's loss, metrics, grad norm and updated weights."""
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    batch = _batch()
    ntok = sum(len(s.completion_ids) for s in batch)
    results = []
    for chunk in (0, 5):
        cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                            "--grpo.micro_batch_size", "3", "--grpo.kl_coef", "0.1", "--grpo.is_correction", "sequence"])
        cfg.grpo.logprob_chunk_tokens = chunk
        d = init_distributed()
        policy = build_policy(cfg, tiny_model_dir, d)
        metrics = train_step(policy, batch, cfg.grpo, 0.7, 8, len(batch), ntok, 0, d)
        results.append((metrics, hf_model.hf_state_dict(policy.model, policy.adapter)))
    (full, full_w), (chunked, chunked_w) = results
    assert full["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "kl", "offpolicy/is_weight_mean",
                "trainer_vs_rollout_logprob_max_abs_diff"):
        assert chunked[key] == pytest.approx(full[key], abs=1e-6, rel=1e-5), key
    for name, value in full_w.items():
        torch.testing.assert_close(chunked_w[name], value, atol=1e-6, rtol=1e-5)


def test_tp_and_pp_keep_the_full_logits_path():
    """TP's output projection is vocab-sharded, PP's loss runs inside the schedule."""
    from torchtitan_grpo.train.trainer import _logprob_chunk_tokens

    cfg = SimpleNamespace(logprob_chunk_tokens=64)
    policy = SimpleNamespace(pipeline=None, parallel_dims=SimpleNamespace(tp_enabled=False))
    assert _logprob_chunk_tokens(policy, cfg) == 64
    assert _logprob_chunk_tokens(policy, SimpleNamespace()) == 0  # the key's default until config/job_config.py has it
    policy.parallel_dims.tp_enabled = True
    assert _logprob_chunk_tokens(policy, cfg) == 0
    policy = SimpleNamespace(pipeline=object(), parallel_dims=SimpleNamespace(tp_enabled=False))
    assert _logprob_chunk_tokens(policy, cfg) == 0


# ------------------------------------------------- FSDP2 / DDP (2 ranks)

# (model, layout) of tests/test_parallel_parity.py: FSDP2 with the tied
# embedding/norm/output group, and DDP's gradient hooks
LAUNCH_CASES = (("qwen3_tied", "fsdp"), ("llama3", "ddp"))


def rank_models(root: str) -> dict[str, str]:
    """The checkpoints of :func:`run_ranks`: rank_cases.write_models' (tests/multirank.py writes them)."""
    return {}


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised 2-rank group: each case's step with full logits,
    then chunked; rank 0 saves ``results.pt``."""
    import torch.distributed as dist

    from tests import rank_cases
    from torchtitan_grpo.train import token_logprobs, trainer

    heads = []
    real_head, real_chunk = token_logprobs.logprob_head, trainer._logprob_chunk_tokens
    trainer.token_logprobs.logprob_head = lambda *a, **k: heads.append(1) or real_head(*a, **k)
    results = {}
    try:
        for model, layout in LAUNCH_CASES:
            for chunk in (0, 5):
                def pick(policy, grpo_cfg, chunk=chunk):
                    grpo_cfg.logprob_chunk_tokens = chunk
                    return real_chunk(policy, grpo_cfg)

                trainer._logprob_chunk_tokens = pick
                heads.clear()
                r = rank_cases.run_step_case(model_dirs[model], model, layout, 2)
                results[(model, layout, chunk)] = {"loss": r["loss"], "grad_norm": r["grad_norm"],
                                                   "grads": r["grads"], "heads": len(heads)}
    finally:
        trainer._logprob_chunk_tokens = real_chunk
        trainer.token_logprobs.logprob_head = real_head
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()


def _launch_worker(models_root: str, out: str) -> None:
    """Under torchrun x2, a launch of its own: :func:`run_ranks`."""
    import torch.distributed as dist

    from tests import rank_cases

    dirs = rank_cases.write_models(models_root)
    dist.init_process_group("gloo")
    run_ranks(os.path.dirname(out), dirs)
    dist.destroy_process_group()


def test_fsdp_and_ddp_run_the_head_and_match_full_logits(request, tmp_path):
    from tests import rank_cases

    if not torch.cuda.is_available():  # CPU: from the suite's shared 2-rank launch (tests/multirank.py)
        out = request.getfixturevalue("multirank_launched").extra("test_chunked_logprobs") / "results.pt"
    else:
        models = tmp_path / "models"
        rank_cases.write_models(str(models))  # once, before the ranks read them
        out = tmp_path / "results.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), str(models), str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), TOKENIZERS_PARALLELISM="false")
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    results = torch.load(out, weights_only=False)
    for model, layout in LAUNCH_CASES:
        full, chunked = results[(model, layout, 0)], results[(model, layout, 5)]
        assert full["heads"] == 0 and chunked["heads"] == 2, (model, layout)  # 2 micro-batches
        assert full["grad_norm"] > 0
        assert chunked["loss"] == pytest.approx(full["loss"], abs=1e-6), (model, layout)
        assert chunked["grad_norm"] == pytest.approx(full["grad_norm"], abs=1e-6, rel=1e-5), (model, layout)
        assert rank_cases.max_diff(full["grads"], chunked["grads"]) <= 1e-6, (model, layout)


if __name__ == "__main__":
    _launch_worker(sys.argv[1], sys.argv[2])
