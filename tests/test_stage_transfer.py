"""torchtitan_grpo.distributed.stage_transfer over 3 real gloo ranks.

Each rank plays a pipeline stage with a hand-made list of tensors that
exercises every rule of the plan: a name rank 0 already holds (under an
alias) is not sent, a tensor held by ranks 1 and 2 comes from rank 1 even
where rank 2 lists it first, a tensor is sent once with all its names, the
skip filter leaves tensors out, and every rank gets the same plan in the
same order (with and without a group). The exchange then runs the plan:
rank 0 ends with every tensor, equal to its sender's, aliases sharing one
tensor; a non-contiguous tensor is sent as its values.
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

WORLD = 3
F32, BF16, I64, F16 = torch.float32, torch.bfloat16, torch.int64, torch.float16

# rank -> its entries (names, shape, dtype), in the order it lists them
ENTRIES = {
    0: [(["a"], (2,), F32), (["tied_x", "tied_y"], (3,), F32)],
    1: [(["b"], (2, 3), F32), (["tied_y"], (3,), F32), (["c", "c_alias"], (4,), BF16),
        (["skip_1"], (1,), F32), (["d"], (5,), I64)],
    2: [(["f"], (2, 2), F16), (["d"], (5,), I64), (["c_alias"], (4,), BF16), (["skip_2"], (1,), F32),
        (["b"], (2, 3), F32), (["g", "g_alias"], (1, 2), F32)],
}
# rank 1's tensors first, each in rank 1's order, then what only rank 2 has
EXPECTED = [(1, ["b"], (2, 3), F32), (1, ["c", "c_alias"], (4,), BF16), (1, ["d"], (5,), I64),
            (2, ["f"], (2, 2), F16), (2, ["g", "g_alias"], (1, 2), F32)]


def _skip(names: list[str], shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return names[0].startswith("skip")


def _value(rank: int, names: list[str], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A value that tells sender and tensor apart (rank 1's "b" is a
    non-contiguous view, so a send that skipped ``contiguous`` would fail)."""
    seed = 100 * rank + sum(map(ord, names[0]))
    t = (torch.arange(int(torch.tensor(shape).prod())) + seed).to(dtype).reshape(shape)
    if rank == 1 and names[0] == "b":
        t = t.reshape(shape[::-1]).clone().t()
        assert not t.is_contiguous()
    return t


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from torchtitan_grpo.distributed import stage_transfer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        entries = ENTRIES[rank]
        world_copy = dist.new_group(list(range(WORLD)))  # as ShardGatherer's own world group
        plan = stage_transfer.plan_to_rank0(entries, world_copy, skip=_skip)
        plan_default = stage_transfer.plan_to_rank0(entries, skip=_skip)
        unskipped = stage_transfer.plan_to_rank0(entries)
        pair = dist.new_group([0, 1])
        try:
            stage_transfer.plan_to_rank0(entries, pair)
            partial = ""
        except ValueError as e:
            partial = str(e)

        tensors = {n: _value(rank, names, shape, dtype) for names, shape, dtype in entries for n in names}
        mine = dict(tensors)
        stage_transfer.exchange_to_rank0(plan, tensors, torch.device("cpu"), world_copy)
        torch.save({"plan": [tuple(t) for t in plan], "plan_default": [tuple(t) for t in plan_default],
                    "unskipped": [tuple(t) for t in unskipped], "partial": partial,
                    "sent_by": stage_transfer.sent_by(plan, rank), "mine": mine, "tensors": tensors,
                    "aliased": tensors["c"] is tensors["c_alias"] if rank == 0 else None},
                   os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()  # leave together: a peer gone early can abort this rank at exit
    finally:
        dist.destroy_process_group()


def test_plan_and_exchange_over_three_ranks(tmp_path):
    # fork, not spawn: the ranks reuse this process's imported torch (three
    # spawned interpreters importing it took ~20 s on the loaded 2-core box, fork ~6 s)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)  # hang guard only
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD

    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r in res:
        assert r["plan"] == EXPECTED
        assert r["plan_default"] == EXPECTED
        assert "whole world" in r["partial"], r["partial"]
    # without the filter the skipped tensors are sent too, each by its only holder
    assert res[0]["unskipped"] == EXPECTED[:2] + [(1, ["skip_1"], (1,), F32), EXPECTED[2], EXPECTED[3],
                                                   (2, ["skip_2"], (1,), F32), EXPECTED[4]]
    assert [r["sent_by"] for r in res] == [set(), {"b", "c", "c_alias", "d"}, {"f", "g", "g_alias"}]

    got = res[0]["tensors"]
    assert sorted(got) == sorted({"a", "tied_x", "tied_y"} | {n for _, names, _, _ in EXPECTED for n in names})
    assert res[0]["aliased"], "rank 0's aliases must share the one received tensor"
    assert got["g"] is got["g_alias"]
    for src, names, shape, dtype in EXPECTED:
        want = res[src]["mine"][names[0]]
        for n in names:
            assert got[n].dtype == dtype and tuple(got[n].shape) == shape, n
            assert torch.equal(got[n], want), n
    assert torch.equal(got["tied_y"], res[0]["mine"]["tied_y"])  # rank 0's own, not rank 1's
    for r in (1, 2):  # the senders' dicts are left as they were
        assert res[r]["tensors"].keys() == res[r]["mine"].keys()
        assert all(torch.equal(res[r]["tensors"][k], v) for k, v in res[r]["mine"].items())
