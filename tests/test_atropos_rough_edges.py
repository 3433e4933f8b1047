"""Issue 37's rough edges of the Atropos recipe, each without real processes
where an in-process stand-in does: atroposlib's own API app served from a
thread of this process (its real routes, state cleared per test), the example
environment's start-up checks, the trainer's stale replica file, and the
import layering of the rollout and inference modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "torchtitan_grpo"


# ------------------------------------------------------------------ layering


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_atropos_modules_do_not_import_the_trainer():
    """The rollout side sits below the trainer: Sample comes from rollout/sample.py."""
    for name in ("atropos.py", "atropos_groups.py"):
        imported = _imported_modules(PKG / "rollout" / name)
        assert "torchtitan_grpo.trainer" not in imported and not any(
            m.startswith("torchtitan_grpo.trainer.") for m in imported), name
        assert "torchtitan_grpo.rollout.sample.Sample" in imported, name


def test_the_kv_batches_do_not_import_each_other():
    batch = _imported_modules(PKG / "inference" / "batch.py")
    static = _imported_modules(PKG / "inference" / "static_batch.py")
    batch_uses_static = any(m.startswith("torchtitan_grpo.inference.static_batch") for m in batch)
    static_uses_batch = any(m == "torchtitan_grpo.inference.batch" or m.startswith("torchtitan_grpo.inference.batch.")
                            for m in static)
    assert not (batch_uses_static and static_uses_batch), "inference/batch.py and static_batch.py import each other"
