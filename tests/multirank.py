"""One torchrun per world size for the multi-rank cases of two test files,
tests/test_parallel_parity.py and tests/test_gather.py, run once per session.

Each rank of a launch imports torch, TorchTitan and transformers and joins a
gloo group; on a 2-core box that start-up costs about as much as the tiny
cases themselves, so both files' cases share one launch per world size
instead of one per file. The cases and their checks are the files' own
(``run_layouts`` of each); only where they run changed. Results go to
``OUT/parity`` and ``OUT/gather``, as each file's own worker writes them.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/multirank.py --out OUT \\
        --model qwen3=PATH --model qwen3_tied=PATH --model llama3=PATH

Each file's own worker (``python tests/test_gather.py ...``, ``python
tests/test_parallel_parity.py worker ...``) still runs alone, as the device
scripts use them.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def launches() -> dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """World size -> (parity layouts, gather layouts, gather layouts also
    staged through rank 0's Pusher), each file's own table of launches."""
    from tests import test_gather as gather
    from tests import test_parallel_parity as parity

    sizes = sorted(set(parity.LAUNCHES) | set(gather.LAUNCHES))
    return {n: (parity.LAUNCHES.get(n, ()), gather.LAUNCHES.get(n, ()), gather.STAGED.get(n, ())) for n in sizes}


def _worker(out: str, model_dirs: dict[str, str]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests import test_gather as gather
    from tests import test_parallel_parity as parity

    # A hang leaves every thread's stack in the rank's stderr instead of only a timeout.
    dump_s = float(os.environ.get("GRPO_TEST_DUMP_S", "600"))  # 0: none
    if dump_s > 0:
        faulthandler.dump_traceback_later(dump_s, repeat=True)
    torch.set_num_threads(1)
    device = parity._device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300))
    parity_layouts, gather_layouts, staged = launches()[dist.get_world_size()]
    try:
        os.makedirs(os.path.join(out, "parity"), exist_ok=True)
        parity.run_layouts(os.path.join(out, "parity"), model_dirs, list(parity_layouts))
        gather.run_layouts(os.path.join(out, "gather"), model_dirs, list(gather_layouts), "", list(staged))
        dist.barrier()  # leave together: a peer gone early can abort this rank at exit
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def launch(nproc: int, out: str, model_dirs: dict[str, str], timeout: float = 900) -> str:
    """torchrun ``nproc`` ranks over :func:`_worker`; returns the log."""
    from tests.test_parallel_parity import run_torchrun

    return run_torchrun(nproc, [os.path.abspath(__file__), "--out", out,
                                *[f"--model={k}={v}" for k, v in model_dirs.items()]], timeout)


@dataclass
class Launched:
    model_dirs: dict[str, str]
    """The tiny qwen3, qwen3_tied and llama3 checkpoints (test_parallel_parity.write_models)."""
    parity: Path
    """test_parallel_parity's results."""
    gather: Path
    """test_gather's results (``staged/``: those through rank 0's Pusher)."""
    errors: dict[int, str]
    """World size -> the failed launch's log tail."""


_SESSION: dict[str, Launched] = {}


def shared(tmp_path_factory) -> Launched:
    """The models and every launch, done once per test session (the first
    file to ask runs them; the other reads the results)."""
    if "launched" not in _SESSION:
        from tests.test_parallel_parity import write_models

        root = tmp_path_factory.mktemp("multirank")
        model_dirs = write_models(str(root / "models"))
        out = root / "results"
        out.mkdir()
        errors = {}
        for nproc in launches():
            try:
                launch(nproc, str(out), model_dirs)
            except RuntimeError as e:  # reported by the tests that read that launch
                errors[nproc] = str(e)
        _SESSION["launched"] = Launched(model_dirs, out / "parity", out / "gather", errors)
    return _SESSION["launched"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", action="append", default=[])
    a = ap.parse_args()
    _worker(a.out, dict(m.split("=", 1) for m in a.model))
