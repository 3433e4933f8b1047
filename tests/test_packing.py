"""Packed micro-batches (torchtitan_grpo.train.packing, grpo.micro_batch_tokens)
against padded ones: the plan, the row's layout and block mask, every GRPO
loss variant and IS mode (loss and gradients, fp32 <= 1e-6) on a tiny random
Qwen3, the chunked log-prob head, and one train_step through build_policy."""

import copy
import itertools
import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from torchtitan_grpo.train import loss as grpo_losses
from torchtitan_grpo.train import packing
from torchtitan_grpo.train.trainer import Sample, _forward_terms, _LossContext, _logprob_loss, _micro_batches, _pack, _reference_logprobs

from tests.conftest import ROOT

DEMO = f"{ROOT}/train_configs/demo_cpu.toml"
V = 97
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": V, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 64}


# ---------------------------------------------------------------- the plan

@pytest.mark.parametrize("seed", range(5))
def test_plan_fills_rows_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    budget = 100
    lengths = torch.randint(2, 140, (40,), generator=g).tolist()  # some longer than the budget
    rows = packing.plan(lengths, budget)
    assert sorted(i for row in rows for i in row) == list(range(40))  # every sample exactly once
    for row in rows:
        total = sum(lengths[i] for i in row)
        assert total <= budget or len(row) == 1, (row, total)
    # first-fit decreasing: no two rows could be merged, and it stays near the bound
    totals = sorted(sum(lengths[i] for i in row) for row in rows)
    assert totals[0] + totals[1] > budget
    fitting = sum(n for n in lengths if n <= budget)
    assert len(rows) <= sum(n > budget for n in lengths) + math.ceil(11 / 9 * fitting / budget) + 1
    assert packing.plan(lengths, budget) == rows  # deterministic


def test_plan_small_cases():
    assert packing.plan([5, 5, 4, 3, 2, 1], 10) == [[0, 1], [2, 3, 4, 5]]
    assert packing.plan([30, 4, 4], 10) == [[0], [1, 2]]
    assert packing.plan([], 10) == []
    with pytest.raises(ValueError, match="grpo.micro_batch_tokens"):
        packing.plan([3], 0)


def test_micro_batches_follow_the_key():
    batch = [Sample([1] * p, [2] * c, [0.0] * c, 0.0, 0.0, "stop", ["0"]) for p, c in ((3, 9), (2, 2), (5, 5))]
    cfg = SimpleNamespace(micro_batch_size=2, micro_batch_tokens=0)
    assert [[len(s.completion_ids) for s in mb] for mb in _micro_batches(batch, cfg)] == [[9, 2], [5]]
    cfg.micro_batch_tokens = 14
    assert [[len(s.completion_ids) for s in mb] for mb in _micro_batches(batch, cfg)] == [[9], [5, 2]]


# ------------------------------------------------------------ one row

def test_row_layout_and_the_way_back():
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    row = packing.pack_row(seqs, pad_id=0, device="cpu", multiple=4)
    assert row.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]]
    assert row.positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 0, 0]]
    assert row.document_ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert row.targets.tolist() == [[6, 7, 8, 0, 10, 0, 12, 13, 0, 0, 0, 0]]
    assert row.offsets == [0, 4, 6] and row.lengths == [4, 2, 3]
    # trainer._pack's [n, T - 1]: position t scores token t + 1; past a sample's end, its first token
    assert row.index.tolist() == [[0, 1, 2], [4, 4, 4], [6, 7, 6]]
    x = torch.arange(12.0).view(1, 12, 1) * 10
    assert row.to_samples(x)[..., 0].tolist() == [[0, 10, 20], [40, 40, 40], [60, 70, 60]]
    # a per-position input (MoE routes: [len - 1, layers, top_k]) laid out like the tokens
    routes = [torch.full((n - 1, 2, 1), i + 1) for i, n in enumerate(row.lengths)]
    laid = row.per_token(routes, fill=-1)
    assert laid.shape == (1, 12, 2, 1)
    assert laid[0, :, 0, 0].tolist() == [1, 1, 1, -1, 2, -1, 3, 3, -1, -1, -1, -1]
    targets = row.to_samples(row.targets.unsqueeze(-1))[..., 0]
    tokens, mask, _, _ = _pack([Sample(s[:1], s[1:], [0.0] * (len(s) - 1), 0.0, 0.0, "stop", []) for s in seqs], 0,
                               "cpu")
    assert torch.equal(targets * mask.long(), tokens[:, 1:] * mask.long())  # same targets where trained


@pytest.mark.parametrize("lengths,block", [([5, 3, 9, 1, 6], 4), ([16], 4), ([2, 2, 2, 2], 4), ([7, 13, 4], 8)])
def test_block_tables_agree_with_the_dense_mask(lengths, block):
    """The tile tables the CUDA kernel reads (the CPU path makes the mask dense
    instead): a tile is listed iff some pair in it attends, and a "full" tile
    has every pair attending."""
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    L = doc.numel()
    bm = packing.document_block_mask(doc, block)
    idx = torch.arange(L)
    dense = bm.mask_mod(0, 0, idx[:, None], idx[None, :])
    want = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
    assert torch.equal(dense, want)
    nb = -(-L // block)
    padded = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    padded[:L, :L] = want
    tiles = padded.view(nb, block, nb, block).transpose(1, 2)
    listed = bm.to_dense()[0, 0].bool()  # partial + full tiles
    assert torch.equal(listed, tiles.any(-1).any(-1))
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for q in range(nb):
        for j in range(int(bm.full_kv_num_blocks[0, 0, q])):
            full[q, int(bm.full_kv_indices[0, 0, q, j])] = True
    valid = torch.zeros(nb * block, dtype=torch.bool)
    valid[:L] = True
    tile_valid = valid.view(nb, block)
    for q, k in full.nonzero().tolist():
        pairs = tiles[q, k][tile_valid[q]][:, tile_valid[k]]
        assert pairs.all(), (q, k)
    assert full.any() == any(n >= 2 * block for n in lengths)


# ------------------------------------------- loss and gradients vs padded

def _batch():
    """Six samples of uneven lengths, off-policy rollout log-probs, one with a loss mask."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i, (p, c) in enumerate(((3, 17), (6, 4), (2, 9), (9, 2), (4, 12), (5, 6))):
        ids = torch.randint(2, V, (p + c,), generator=g).tolist()
        old = (-math.log(V) + 0.3 * torch.randn(c, generator=g)).tolist()
        mask = [float(k % 3 != 1) for k in range(c)] if i == 4 else None
        out.append(Sample(ids[:p], ids[p:], old, (-1.0) ** i * (0.5 + i / 4), 0.0, "stop", ["0"], loss_mask=mask))
    return out


@pytest.fixture(scope="module")
def models():
    """A tiny random Qwen3 and, as KL reference, a perturbed copy (a policy a
    few steps from its start), each padded (SDPA, causal) and packed
    (document attention): same weights."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    args = hf_model.model_args_from_hf("qwen3", TINY, max_seq_len=64)
    torch.manual_seed(0)
    policy = hf_model.build_model("qwen3", args, "cpu")
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    packed, packed_ref = copy.deepcopy(policy), copy.deepcopy(reference)
    assert packing.use_document_attention(packed) == 2 and packing.use_document_attention(packed_ref) == 2
    return policy, reference, packed, packed_ref


def _ctx(loss_agg, is_correction, kl_coef, batch):
    g = SimpleNamespace(is_correction=is_correction, is_cap=1.5, clip_low=0.2, clip_high=0.28, loss_agg=loss_agg,
                        kl_coef=kl_coef, kl_estimator="k3")
    ntok = sum(s.num_loss_tokens for s in batch)
    return _LossContext(g, 0.7, max(len(s.completion_ids) for s in batch), len(batch), ntok)


def _padded_step(model, reference, batch, ctx, chunk):
    """One padded micro-batch of the whole batch: loss, records, gradients."""
    model.zero_grad()
    tokens, mask, old, adv = _pack(batch, 0, "cpu")
    lp, ent = _forward_terms(model, tokens, mask, ctx.temperature, chunk, nullcontext())
    ref = _reference_logprobs(reference, tokens, ctx.temperature, chunk, nullcontext()) if ctx.grpo_cfg.kl_coef else None
    loss, record = _logprob_loss(lp, ent, mask, old, adv, ctx, ref)
    loss.backward()
    return float(loss.detach()), record["entropy"], {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_step(model, reference, batch, ctx, chunk, budget):
    """The trainer's packed loop: one row per micro-batch, gradients accumulated."""
    model.zero_grad()
    total, entropy, rows = 0.0, 0.0, packing.plan([len(s.prompt_ids) + len(s.completion_ids) for s in batch], budget)
    for plan_row in rows:
        chunk_samples = [batch[i] for i in plan_row]
        _, mask, old, adv = _pack(chunk_samples, 0, "cpu")
        row = packing.pack_row([[*s.prompt_ids, *s.completion_ids] for s in chunk_samples], 0, "cpu", multiple=8)
        lp, ent = packing.forward_terms(model, row, mask, ctx.temperature, chunk, nullcontext())
        ref = packing.reference_logprobs(reference, row, ctx.temperature, chunk, nullcontext()) \
            if ctx.grpo_cfg.kl_coef else None
        loss, record = _logprob_loss(lp, ent, mask, old, adv, ctx, ref)
        loss.backward()
        total += float(loss.detach())
        entropy += record["entropy"]
    return total, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}, len(rows)


@pytest.mark.parametrize("loss_agg,is_correction,kl_coef", list(itertools.product(
    grpo_losses.LOSS_AGGREGATIONS, ["none", "token", "sequence"], [0.0, 0.3])))
def test_every_loss_variant_matches_the_padded_path(models, loss_agg, is_correction, kl_coef):
    policy, reference, packed, packed_ref = models
    batch = _batch()
    ctx = _ctx(loss_agg, is_correction, kl_coef, batch)
    loss, entropy, grads = _padded_step(policy, reference, batch, ctx, 0)
    p_loss, p_entropy, p_grads, n_rows = _packed_step(packed, packed_ref, batch, ctx, 0, budget=24)
    assert n_rows == 4  # lengths 20, 10, 11, 11, 16, 11: [20] [16] [11 11] [11 10]
    assert loss != 0.0
    assert p_loss == pytest.approx(loss, abs=1e-6)
    assert p_entropy == pytest.approx(entropy, rel=1e-6)  # a sum over tokens
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(p_grads[name], g, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("is_correction,kl_coef", [("sequence", 0.3), ("token", 0.0)])
def test_chunked_logprobs_packed_match_the_padded_full_logits(models, is_correction, kl_coef):
    policy, reference, packed, packed_ref = models
    batch = _batch()
    ctx = _ctx("seq_mean_token_mean", is_correction, kl_coef, batch)
    loss, entropy, grads = _padded_step(policy, reference, batch, ctx, 0)
    p_loss, p_entropy, p_grads, _ = _packed_step(packed, packed_ref, batch, ctx, 5, budget=40)  # 5: no row divides
    assert p_loss == pytest.approx(loss, abs=1e-6)
    assert p_entropy == pytest.approx(entropy, rel=1e-6)  # a sum over tokens
    for name, g in grads.items():
        torch.testing.assert_close(p_grads[name], g, atol=1e-6, rtol=0, msg=name)


def test_a_samples_logprobs_ignore_its_row_neighbours(models):
    policy, _, packed, _ = models
    batch = _batch()
    target = batch[2]
    seq = [*target.prompt_ids, *target.completion_ids]
    _, mask, _, _ = _pack([target], 0, "cpu")
    alone = packing.forward_terms(packed, packing.pack_row([seq], 0, "cpu"), mask, 1.0, 0, nullcontext())[0]
    others = [[*s.prompt_ids, *s.completion_ids] for s in (batch[0], batch[3])]
    with torch.no_grad():
        row = packing.pack_row([others[0], seq, others[1]], 0, "cpu", multiple=16)
        lp = packing.forward_terms(packed, row, torch.ones(3, row.index.shape[1]), 1.0, 0, nullcontext())[0]
        padded = _forward_terms(policy, torch.tensor([seq]), mask, 1.0, 0, nullcontext())[0]
    n = len(seq) - 1
    torch.testing.assert_close(lp[1, :n], alone[0, :n], atol=1e-6, rtol=0)
    torch.testing.assert_close(lp[1, :n], padded[0, :n], atol=1e-6, rtol=0)
    # and the neighbours do see a different context than they would with another middle sample
    row2 = packing.pack_row([others[0], seq[:-3], others[1]], 0, "cpu", multiple=16)
    with torch.no_grad():
        lp2 = packing.forward_terms(packed, row2, torch.ones(3, row2.index.shape[1]), 1.0, 0, nullcontext())[0]
    torch.testing.assert_close(lp2[2, :5], lp[2, :5], atol=1e-6, rtol=0)  # shifted in the row, same values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention: CUDA only (GPU machines)")
@pytest.mark.parametrize("is_correction,kl_coef", [("sequence", 0.3), ("none", 0.0)])
def test_compiled_flex_on_cuda_matches_the_padded_path(is_correction, kl_coef):
    """The CUDA route (flex attention reading the block tables) on rows long
    enough for skipped, full and partial tiles, in float32."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    torch.backends.cuda.matmul.allow_tf32 = False
    shape = {**TINY, "head_dim": 16, "max_position_embeddings": 1024}  # flex kernels: head_dim >= 16
    args = hf_model.model_args_from_hf("qwen3", shape, max_seq_len=1024)
    torch.manual_seed(0)
    policy = hf_model.build_model("qwen3", args, "cuda")
    reference = copy.deepcopy(policy).requires_grad_(False)
    packed, packed_ref = copy.deepcopy(policy), copy.deepcopy(reference)
    packing.use_document_attention(packed), packing.use_document_attention(packed_ref)
    g = torch.Generator().manual_seed(5)
    batch = []
    for i, (p, c) in enumerate(((20, 380), (5, 40), (30, 270), (9, 140), (3, 300), (6, 7))):
        ids = torch.randint(2, V, (p + c,), generator=g).tolist()
        old = (-math.log(V) + 0.3 * torch.randn(c, generator=g)).tolist()
        batch.append(Sample(ids[:p], ids[p:], old, (-1.0) ** i, 0.0, "stop", ["0"]))
    ctx = _ctx("seq_mean_token_mean", is_correction, kl_coef, batch)

    def run(model, ref, rows):
        model.zero_grad()
        total = 0.0
        for r in rows:
            samples = [batch[i] for i in r]
            tokens, mask, old, adv = (x.cuda() for x in _pack(samples, 0, "cpu"))
            if model is packed:
                row = packing.pack_row([[*s.prompt_ids, *s.completion_ids] for s in samples], 0, "cuda",
                                       packing.CUDA_ROW_MULTIPLE)
                lp, ent = packing.forward_terms(model, row, mask, 0.7, 0, nullcontext())
                rl = packing.reference_logprobs(ref, row, 0.7, 0, nullcontext())
            else:
                lp, ent = _forward_terms(model, tokens, mask, 0.7, 0, nullcontext())
                rl = _reference_logprobs(ref, tokens, 0.7, 0, nullcontext())
            loss, _ = _logprob_loss(lp, ent, mask, old, adv, ctx, rl if kl_coef else None)
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = run(policy, reference, [[i] for i in range(len(batch))])
    p_loss, p_grads = run(packed, packed_ref, packing.plan([len(s.prompt_ids) + len(s.completion_ids)
                                                             for s in batch], 700))
    assert p_loss == pytest.approx(loss, abs=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(p_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------ wiring

def test_train_step_packed_matches_padded(tiny_model_dir):
    """build_policy + train_step (KL reference, sequence IS, chunked head):
    packed rows give the padded step's loss, metrics, grad norm and weights."""
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    batch = _batch()
    ntok = sum(s.num_loss_tokens for s in batch)
    results = []
    for budget in (0, 30):
        cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                            "--grpo.micro_batch_size", "3", "--grpo.kl_coef", "0.1", "--grpo.is_correction", "sequence"])
        cfg.grpo.micro_batch_tokens, cfg.grpo.logprob_chunk_tokens = budget, 7
        d = init_distributed()
        policy = build_policy(cfg, tiny_model_dir, d)
        metrics = train_step(policy, batch, cfg.grpo, 0.7, 17, len(batch), ntok, 0, d)
        results.append((metrics, hf_model.hf_state_dict(policy.model, policy.adapter)))
    (padded, padded_w), (packed, packed_w) = results
    assert padded["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "kl", "offpolicy/is_weight_mean",
                "trainer_vs_rollout_logprob_max_abs_diff"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-6, rel=1e-5), key
    # on CUDA the two attention kernels differ (flex vs SDPA), and AdamW's
    # normalised first step turns a ~1e-9 gradient difference on a near-zero
    # gradient into ~2e-6 (seen on an H200); on CPU the same SDPA math runs
    # fp32 on CPU: padded and packed rows take differently shaped GEMMs (1.6e-6
    # apart on a Xeon without AVX-512, 2026-11-29); a wrong mask or position is far larger.
    atol = 1e-5 if torch.cuda.is_available() else 4e-6
    for name, value in padded_w.items():
        torch.testing.assert_close(packed_w[name], value, atol=atol, rtol=1e-5)


def test_layouts_it_cannot_run_in_are_refused():
    def cfg(budget=64, pp=1, tp=1):
        return SimpleNamespace(grpo=SimpleNamespace(micro_batch_tokens=budget), parallelism=SimpleNamespace(
            pipeline_parallel_degree=pp, tensor_parallel_degree=tp, context_parallel_degree=1))

    packing.check_layout(cfg())
    packing.check_layout(cfg(budget=0, pp=2, tp=2))  # off: nothing to refuse
    for bad, words in ((cfg(pp=2), "pipeline"), (cfg(tp=2), "tensor"), (cfg(budget=-1), ">= 0")):
        with pytest.raises(ValueError, match=f"^grpo.micro_batch_tokens = .*{words}"):
            packing.check_layout(bad)
    with pytest.raises(ValueError, match="grpo.micro_batch_tokens: Sequential"):
        packing.use_document_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))
