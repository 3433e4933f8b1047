"""Expert parallelism beyond 2 ranks: tests/test_expert_parallel.py's parity
check (one GRPO forward/backward and a push of a tiny Qwen3-MoE, compared
with one process) on 4 CPU ranks over gloo, for the layouts 2 ranks cannot
make:

* ``ep2_hsdp``: dp_replicate 2 x dp_shard 2, EP 2 over dp_shard (HSDP);
* ``ep2_efsdp2``: dp_shard 4, EP 2 (experts also FSDP-sharded: efsdp 2).

Not in the CI suite (4 ranks on a 2-core box take minutes); docs/MOE.md
records the command and the result.

    OMP_NUM_THREADS=1 python scripts/ep_parity_4ranks.py [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import test_expert_parallel as tep  # noqa: E402  (imports torchtitan_grpo first)

# name -> (dp_replicate, dp_shard, tp); expert_parallel_degree tep.EP (2)
LAYOUTS = {"ep2_hsdp": (2, 2, 1), "ep2_efsdp2": (1, 4, 1)}


def compare(ref: dict, got: dict) -> dict:
    """The test's checks as numbers: loss, grad norm and gradient differences,
    and how many pushed tensors differ from the single process's bit for bit."""
    import torch

    bad = [k for k, v in ref["pushed"].items() if k not in got["pushed"] or not torch.equal(v, got["pushed"][k])]
    return {
        "ep": got["ep"],
        "loss_diff": abs(got["loss"] - ref["loss"]),
        "grad_norm_rel_diff": abs(got["grad_norm"] - ref["grad_norm"]) / max(1.0, ref["grad_norm"]),
        "max_grad_diff": tep._max_diff(ref["grads"], got["grads"]),
        "pushed": len(got["pushed"]),
        "pushed_not_equal": len(bad) + len(set(got["pushed"]) - set(ref["pushed"])),
        "expert_gather_kinds": sorted({v for k, v in got["kinds"].items() if "moe.experts" in k}),
        "seconds": got["seconds"],
    }


def main() -> int:
    import torch

    from tests.rank_cases import run_torchrun

    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", choices=["worker"])
    ap.add_argument("--work", default="", help="folder for the checkpoint and the results (default: a temp dir)")
    ap.add_argument("--out")
    ap.add_argument("--model")
    a = ap.parse_args()
    if a.mode == "worker":  # one rank of the launch: the test's own worker, over these layouts
        tep.LAYOUTS = LAYOUTS
        tep._worker(a.out, a.model)
        return 0
    work = a.work or tempfile.mkdtemp(prefix="ep_parity_4ranks-")
    model_dir = tep.write_checkpoint(os.path.join(work, "moe"))
    out = os.path.join(work, "results")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    run_torchrun(4, [os.path.abspath(__file__), "worker", "--out", out, "--model", model_dir], 1800)
    launch_s = time.perf_counter() - t0
    ref = tep.run_case(model_dir, (1, 1, 1), 1, 1)
    ok = True
    print(f"torchrun x4 (gloo, CPU): {launch_s:.0f} s; tolerance {tep.TOL:g}")
    for name in LAYOUTS:
        c = compare(ref, torch.load(os.path.join(out, f"{name}.pt"), weights_only=False))
        within = max(c["loss_diff"], c["grad_norm_rel_diff"], c["max_grad_diff"]) <= tep.TOL
        passed = within and c["ep"] == tep.EP and c["pushed_not_equal"] == 0 and c["pushed"] == len(ref["pushed"])
        ok &= passed
        print(f"{name}: {'PASS' if passed else 'FAIL'} " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
