"""One torchrun per world size for the multi-rank cases of the test files
tests/test_parallel_parity.py and tests/test_gather.py (and ``EXTRAS`` on
CPU), run once per session, for the files the session collected.

Each rank of a launch imports torch, TorchTitan and transformers and joins a
gloo group; on a 2-core box that start-up costs about as much as the tiny
cases themselves, so both files' cases share one launch per world size
instead of one per file. The cases and their checks are the files' own
(``run_layouts`` of each); only where they run changed. Results go to
``OUT/parity`` and ``OUT/gather``, as each file's own worker writes them.

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/multirank.py --out OUT \\
        --model qwen3=PATH --model qwen3_tied=PATH --model llama3=PATH

On CPU the 2-rank launch also runs the 2-rank cases of ``EXTRAS`` (LoRA x
FSDP2 and x PP, llama3 tied, expert and context parallel, the chunked log-prob
head, test_hf_mapping's FSDP2 load and export) in the same process group, and
the 4-rank launch those of ``EXTRAS_4`` (CP x TP), after these two files' (one torchrun start for all, not one per file).

Each file's own worker (``python tests/test_gather.py ...``, ``python
tests/test_parallel_parity.py worker ...``) still runs alone, as the device
scripts use them.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# Other files whose 2-rank cases ride on the 2-rank launch on CPU (on GPUs
# each launches its own, as before). Each module has ``rank_models(root) ->
# {name: dir}`` (its checkpoints, written before the launch) and
# ``run_ranks(out_dir, model_dirs)`` (its cases in the launch's initialised
# group, results under out_dir). CP last: its ring attention patches SDPA.
EXTRAS = ("test_llama_tied", "test_expert_parallel", "test_lora_sharded", "test_lora_pp", "test_chunked_logprobs",
          "test_hf_mapping", "test_context_parallel")
EXTRAS_4 = ("test_context_parallel",)  # CP 2 x TP 2; its run_ranks picks its cases by world size


def extras(nproc: int) -> tuple[str, ...]:
    import torch

    return () if torch.cuda.is_available() else {2: EXTRAS, 4: EXTRAS_4}.get(nproc, ())


def _run_extras(out: str, model_dirs: dict[str, str], names: tuple[str, ...]) -> None:
    """Each extra file's cases; a failure is written to that file's folder
    (``error-rank*.txt``, its tests report it) and the next file still runs."""
    import traceback

    import torch.distributed as dist

    for name in names:
        case_out = os.path.join(out, name if dist.get_world_size() == 2 else f"{name}-{dist.get_world_size()}")
        os.makedirs(case_out, exist_ok=True)
        try:
            importlib.import_module(f"tests.{name}").run_ranks(case_out, model_dirs)
        except Exception:
            with open(os.path.join(case_out, f"error-rank{dist.get_rank()}.txt"), "w") as f:
                f.write(traceback.format_exc())
        _finished(out, name)


def _finished(out: str, section: str) -> None:
    """This rank is through ``section`` of its launch (its results, or its
    error file, are written): a launch that dies later (a rank killed by a
    signal in a later section) leaves this section's results standing; only
    the sections some rank did not mark fail with the launch's log."""
    import torch.distributed as dist

    open(os.path.join(out, marker(section, dist.get_world_size(), dist.get_rank())), "w").close()


def session_files(session) -> set[str]:
    """The stems of the test files a pytest session collected (what :func:`launches` takes)."""
    return {os.path.splitext(os.path.basename(str(item.fspath)))[0] for item in session.items}


def marker(section: str, nproc: int, rank: int | str = "*") -> str:
    """The name of rank ``rank``'s marker for ``section`` of the ``nproc``-rank launch
    (``"*"``: a glob over its ranks)."""
    return f"done-{section}-{nproc}.rank{rank}"


def launches(files: set[str] | None = None) -> dict[int, tuple[tuple[str, ...], ...]]:
    """World size -> (parity layouts, gather layouts, gather layouts also
    staged through rank 0's Pusher, extra files), each file's own table of
    launches; only the parts of ``files`` (test file stems; None: all), so
    that a run of one file launches only what it reads."""
    from tests import test_gather as gather
    from tests import test_parallel_parity as parity

    def wanted(name: str) -> bool:
        return files is None or name in files

    table = {}
    for n in sorted(set(parity.LAUNCHES) | set(gather.LAUNCHES) | {2}):
        part = (parity.LAUNCHES.get(n, ()) if wanted("test_parallel_parity") else (),
                gather.LAUNCHES.get(n, ()) if wanted("test_gather") else (),
                gather.STAGED.get(n, ()) if wanted("test_gather") else (),
                tuple(e for e in extras(n) if wanted(e)))
        if any(part):
            table[n] = part
    return table


def _worker(out: str, model_dirs: dict[str, str], files: set[str] | None) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests import test_gather as gather
    from tests import test_parallel_parity as parity
    from tests.rank_cases import _device

    # A hang leaves every thread's stack in the rank's stderr instead of only a timeout.
    dump_s = float(os.environ.get("GRPO_TEST_DUMP_S", "600"))  # 0: none
    if dump_s > 0:
        faulthandler.dump_traceback_later(dump_s, repeat=True)
    torch.set_num_threads(1)
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300))
    parity_layouts, gather_layouts, staged, extra = launches(files)[dist.get_world_size()]
    try:
        os.makedirs(os.path.join(out, "parity"), exist_ok=True)
        if parity_layouts:
            parity.run_layouts(os.path.join(out, "parity"), model_dirs, list(parity_layouts))
            _finished(out, "parity")
        if gather_layouts:
            gather.run_layouts(os.path.join(out, "gather"), model_dirs, list(gather_layouts), "", list(staged))
            _finished(out, "gather")
        _run_extras(out, model_dirs, extra)
        dist.barrier()  # leave together: a peer gone early can abort this rank at exit
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def launch(nproc: int, out: str, model_dirs: dict[str, str], timeout: float = 900,
           files: set[str] | None = None) -> str:
    """torchrun ``nproc`` ranks over :func:`_worker`; returns the log."""
    from tests.rank_cases import run_torchrun

    only = [f"--files={','.join(sorted(files))}"] if files is not None else []
    return run_torchrun(nproc, [os.path.abspath(__file__), "--out", out, *only,
                                *[f"--model={k}={v}" for k, v in model_dirs.items()]], timeout)


@dataclass
class Launched:
    model_dirs: dict[str, str]
    """The tiny qwen3, qwen3_tied and llama3 checkpoints (rank_cases.write_models)."""
    parity: Path
    """test_parallel_parity's results."""
    gather: Path
    """test_gather's results (``staged/``: those through rank 0's Pusher)."""
    errors: dict[int, str]
    """World size -> the failed launch's log tail."""
    root: Path = Path()
    """Every launch's results (``EXTRAS``' under their own names)."""

    def failed(self, section: str) -> dict[int, str]:
        """World size -> the launch's log, for the failed launches in which
        some rank did not get through ``section`` ("parity", "gather" or an
        extra file's stem); sections finished before the failure are not in
        it (their results were written)."""
        return {n: log for n, log in self.errors.items()
                if len(list(self.root.glob(marker(section, n)))) < n}

    def extra(self, name: str, nproc: int = 2) -> Path:
        """``name``'s results in the ``nproc``-rank launch (one of ``EXTRAS``
        or ``EXTRAS_4``); fails its test with that launch's log or the
        traceback its cases left."""
        import pytest

        crashed = self.failed(name)
        if nproc in crashed:
            pytest.fail(crashed[nproc])
        out = self.root / (name if nproc == 2 else f"{name}-{nproc}")
        failed = sorted(out.glob("error-rank*.txt"))
        if failed:
            pytest.fail("\n".join(f"{f.name}:\n{f.read_text()}" for f in failed))
        return out


_SESSION: dict[str, Launched] = {}


def shared(tmp_path_factory, files: set[str] | None = None) -> Launched:
    """The models and every launch, done once per test session (the first
    file to ask runs them; the others read the results); only the parts of
    ``files`` (test file stems of the session; None: all)."""
    if "launched" not in _SESSION:
        from tests.rank_cases import write_models

        root = tmp_path_factory.mktemp("multirank")
        model_dirs = write_models(str(root / "models"))
        for name in {e for part in launches(files).values() for e in part[3]}:
            model_dirs.update(importlib.import_module(f"tests.{name}").rank_models(str(root / "models")))
        out = root / "results"
        out.mkdir()
        errors = {}
        for nproc in launches(files):
            try:
                launch(nproc, str(out), model_dirs, files=files)
            except RuntimeError as e:  # reported by the tests that read that launch
                errors[nproc] = str(e)
        _SESSION["launched"] = Launched(model_dirs, out / "parity", out / "gather", errors, out)
    return _SESSION["launched"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--files", default=None, help="comma-separated test file stems (default: all)")
    a = ap.parse_args()
    _worker(a.out, dict(m.split("=", 1) for m in a.model), set(a.files.split(",")) if a.files is not None else None)
