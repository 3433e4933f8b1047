"""The paged decode-attention kernel (issue 38): the same output as a plain
torch reference over the block table, and a paged batch running it gives the
static batch's logits.

The kernel runs on CUDA with triton. On a CPU with triton installed,
``TRITON_INTERPRET=1`` runs it in triton's interpreter (slow, small shapes;
triton 3.5's interpreter needs numpy < 2.4):

  TRITON_INTERPRET=1 python -m pytest -q tests/test_paged_attention.py

Elsewhere (CI: no GPU, no triton) only the grid arithmetic runs; the batches'
gather + SDPA path is tests/test_paged_batch.py's.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_grpo.server.engine import paged_attention
from torchtitan_grpo.server.engine.paged_attention import MIN_SPLIT, paged_decode, splits
from tests.kv_stubs import Req as _Req, Seq as _Seq, scripted_decode

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(
    not paged_attention.available(DEVICE),
    reason="needs CUDA with triton, or triton and TRITON_INTERPRET=1 on a CPU")


def _reference(q, k, v, table, pos, scale) -> torch.Tensor:
    """fp32 attention of each row over positions 0..pos, read block by block through ``table``."""
    rows, n_heads, _ = q.shape
    bs, n_kv = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(rows):
        p = torch.arange(int(pos[r]) + 1)
        blk = table[r].cpu()[p // bs]
        keys = k.cpu()[blk, p % bs].float().repeat_interleave(n_heads // n_kv, 1)  # [len, heads, hd]
        values = v.cpu()[blk, p % bs].float().repeat_interleave(n_heads // n_kv, 1)
        w = (torch.einsum("hd,lhd->hl", q[r].cpu().float(), keys) * scale).softmax(-1)
        out[r] = torch.einsum("hl,lhd->hd", w, values)
    return out


def _case(rows: int, n_kv: int, group: int, hd: int, nb: int, bs: int, dtype: torch.dtype, seed: int):
    """A random pool, a block table with a wider row stride than the step's
    ``nb`` and scattered block ids, q a view with a wider row stride (as the
    fused projection's output), ragged positions: 0 (one position), exact
    block multiples - 1 and + 0, the widest, and random."""
    g = torch.Generator().manual_seed(seed)
    blocks = rows * nb + 1
    k = torch.randn((blocks, bs, n_kv, hd), generator=g).to(dtype)
    v = torch.randn((blocks, bs, n_kv, hd), generator=g).to(dtype)
    table = torch.randperm(blocks - 1, generator=g)[: rows * nb].add(1).view(rows, nb)
    table = torch.cat([table, torch.zeros((rows, 3), dtype=torch.long)], 1)[:, :nb]
    width = nb * bs
    pos = torch.randint(0, width, (rows,), generator=g)
    edges = [p for p in (0, bs - 1, bs, 2 * bs - 1, width - 1) if p < width][:rows]
    pos[: len(edges)] = torch.tensor(edges)
    qkv = torch.randn((rows, n_kv * (group + 2), hd), generator=g).to(dtype)
    q = qkv[:, : n_kv * group]
    return [t.to(DEVICE) for t in (q, k, v, table, pos)]


CASES = {  # rows, kv heads, group, head_dim, blocks per row, block size
    "gqa4-one-row-many-splits": (1, 2, 4, 32, 48, 16),
    "gqa4-rows-one-split": (5, 2, 4, 16, 4, 16),
    "mha-rows-splits": (20, 3, 1, 16, 33, 16),
    "gqa4-qwen3-head-dim": (8, 2, 4, 128, 34, 16),
    "static-cache-view": (6, 2, 2, 16, 1, 96),  # a slot cache [slots, max_len, ...]: one block of max_len per row
}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_equals_reference(case, dtype):
    rows, n_kv, group, hd, nb, bs = CASES[case]
    q, k, v, table, pos = _case(rows, n_kv, group, hd, nb, bs, dtype, seed=len(case))
    out = paged_decode(q, k, v, table, pos, scale=hd**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    want = _reference(q, k, v, table, pos, hd**-0.5)
    # bf16: the probabilities meet V in bf16 (as flash attention does) and the output is rounded to bf16.
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float().cpu(), want, **tol)


TUNINGS = {  # each a way bench/paged_attention.py --sweep may cut a launch: the same attention
    "head-first": paged_attention.Tuning(head_first=True),
    "tile32-many-splits": paged_attention.Tuning(tile=32, min_split=32, programs_per_sm=64, num_stages=3),
    "tile128-head-first": paged_attention.Tuning(tile=128, min_split=128, head_first=True, num_warps=8),
}


@needs_kernel
@pytest.mark.parametrize("tuning", list(TUNINGS), ids=list(TUNINGS))
@pytest.mark.parametrize("case", ["gqa4-one-row-many-splits", "mha-rows-splits", "static-cache-view"])
def test_every_tuning_equals_reference(case, tuning):
    rows, n_kv, group, hd, nb, bs = CASES[case]
    q, k, v, table, pos = _case(rows, n_kv, group, hd, nb, bs, torch.float32, seed=len(case))
    out = paged_decode(q, k, v, table, pos, scale=hd**-0.5, tuning=TUNINGS[tuning])
    torch.testing.assert_close(out.cpu(), _reference(q, k, v, table, pos, hd**-0.5), atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("case", ["static-cache-view", "gqa4-qwen3-head-dim"])
def test_shared_rows_read_their_prefix_through_the_source_rows_table(case):
    """``shared``: rows 1 and 2 read their first positions through row 0's table entries. Their
    own blocks hold NaN there, so the output is finite only if nothing of those is read, and it
    equals the reference over a pool where those positions are row 0's."""
    rows, n_kv, group, hd, nb, bs = CASES[case]
    q, k, v, table, pos = _case(rows, n_kv, group, hd, nb, bs, torch.float32, seed=3)
    third = bs + 3 if nb > 1 else bs - 3  # past a block boundary where there is one
    pos[:3] = torch.tensor([nb * bs - 1, nb * bs - 2, third])
    length = torch.tensor([0, nb * bs // 2 + 1, third] + [0] * (rows - 3), device=DEVICE)
    src = torch.tensor([0, 0, 0] + list(range(3, rows)), device=DEVICE)
    want_k, want_v = k.clone(), v.clone()
    for r in (1, 2):
        p = torch.arange(int(length[r]), device=DEVICE)
        for pool, want in ((k, want_k), (v, want_v)):
            want[table[r][p // bs], p % bs] = pool[table[0][p // bs], p % bs]
            pool[table[r][p // bs], p % bs] = float("nan")
    out = paged_decode(q, k, v, table, pos, scale=hd**-0.5, shared=(src, length))
    torch.testing.assert_close(out.cpu(), _reference(q, want_k, want_v, table, pos, hd**-0.5), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_kernel_reads_nothing_past_a_rows_position():
    """Garbage (NaN) in every position after a row's ``pos``, in its own
    blocks and in the table's unused entries' block: the output is finite and unchanged."""
    q, k, v, table, pos = _case(4, 2, 4, 16, 40, 16, torch.float32, seed=1)
    want = paged_decode(q, k, v, table, pos, scale=0.25)
    k, v = k.clone(), v.clone()
    for r in range(4):
        p = torch.arange(int(pos[r]) + 1, table.shape[1] * 16, device=DEVICE)
        k[table[r][p // 16], p % 16] = float("nan")
        v[table[r][p // 16], p % 16] = float("nan")
    torch.testing.assert_close(paged_decode(q, k, v, table, pos, scale=0.25), want, atol=0, rtol=0)


def test_splits_fill_the_gpu_and_cover_the_context():
    """The grid: several programs per SM at 64 rows x 8 KV heads of a 16k
    context, no split shorter than MIN_SPLIT, one split for short contexts,
    and the splits cover every position exactly once."""
    n, per = splits(64, 8, 16384, 132)
    assert n * 64 * 8 >= 4 * 132 and per >= MIN_SPLIT
    assert splits(64, 8, 256, 132)[0] == 1
    n1, per1 = splits(1, 8, 16384, 132)
    assert n1 > n and per1 >= MIN_SPLIT
    for rows, width in ((1, 16384), (64, 16384), (3, 1040), (64, 64), (1, 528)):
        n, per = splits(rows, 8, width, 132)
        assert per % paged_attention.BLOCK_N == 0 and (n - 1) * per < width <= n * per


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False).to(
        DEVICE)


@needs_kernel
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_paged_batch_with_the_kernel_equals_static(model, graphs):
    """Batch level, fp32: the paged batch decoding through the kernel (with
    its CUDA graphs on a GPU) gives the static batch's logits, over contexts
    long enough for several splits and across block boundaries, a row leaving
    and one joining."""
    from torchtitan_grpo.server.engine.paged_batch import PagedBatch
    from torchtitan_grpo.server.engine.static_batch import StaticBatch

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()  # noqa: E731
    shared = _Req(rand(530))
    first = [_Seq(shared, 0), _Seq(shared, 1), _Seq(_Req(rand(16))), _Seq(_Req(rand(2)), output_ids=rand(47))]
    late = rand(17)
    runs = {}
    graphs = graphs and DEVICE.type == "cuda"
    for name, batch in (("static", StaticBatch(model, DEVICE, slots=6, max_len=640, graphs=False)),
                        ("paged", PagedBatch(model, DEVICE, slots=6, max_len=640, num_blocks=6 * 40 + 1,
                                             graphs=graphs))):
        assert name == "static" or batch.kernel
        out = scripted_decode(batch, first, late)
        if batch.graphs:
            assert batch._graphs, "no decode graph was captured"
        runs[name] = out
    # The 530-token context decodes in steps of 576 positions: several splits.
    assert splits(4, batch.n_kv, 576, paged_attention._sm_count(DEVICE))[0] > 1
    # every step's rows that differ, so a failure says where (step, rows)
    bad = [(i, [r for r in range(len(s)) if not torch.allclose(p[r], s[r], atol=1e-4, rtol=1e-4)])
           for i, (s, p) in enumerate(zip(runs["static"], runs["paged"]))]
    assert [b for b in bad if b[1]] == [], bad


@needs_kernel
@pytest.mark.parametrize("leaving", [0, 1], ids=["source-leaves", "sibling-leaves"])
def test_static_batch_shared_prompts_change_no_bit(model, leaving, monkeypatch):
    """Batch level, fp32: three samples of one 530-token prompt read it through one slot
    (``server/engine/shared_prompts.py``) and give the same logits, to the bit, as each reading
    its own copy; also after the sample whose slot the others read leaves, and a prompt joins."""
    from torchtitan_grpo.server.engine.static_batch import StaticBatch

    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()  # noqa: E731
    prompt = _Req(rand(530))
    first = [_Seq(prompt, 0), _Seq(prompt, 1), _Seq(prompt, 2), _Seq(_Req(rand(16)))]
    late = rand(17)
    keep = tuple(i for i in range(4) if i != leaving)
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("TORCHTITAN_GRPO_SHARED_PROMPTS", on)
        batch = StaticBatch(model, DEVICE, slots=6, max_len=640, graphs=DEVICE.type == "cuda")
        assert (batch.shared is not None) == (on == "1")
        runs[on] = scripted_decode(batch, first, late, keep=keep)
        if on == "1":  # slot 0's copy, or slot 1's once slot 0 left; the late prompt took the freed slot
            assert (batch.shared._src[:3], batch.shared._length[:3]) == (
                ([0, 1, 1], [0, 0, 530]) if leaving == 0 else ([0, 1, 0], [0, 0, 530]))
    assert all(torch.equal(a, b) for a, b in zip(runs["1"], runs["0"]))
