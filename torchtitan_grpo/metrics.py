"""One console line per step, TensorBoard scalars and a metrics.jsonl file
(one JSON object per step) under the dump folder."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("torchtitan_grpo")
TB_FLUSH_SECS = 5


class MetricLogger:
    def __init__(self, dump_folder: str, tb_folder: str = "tb", enable_tensorboard: bool = True,
                 resume_step: int | None = None):
        """``resume_step``: a resumed run keeps the metrics.jsonl rows of steps
        up to it (a stopped run may have logged later steps) and appends."""
        self.history: list[dict[str, float]] = []
        """This process's training steps."""
        self.resume_step = resume_step
        self.writer = None
        os.makedirs(dump_folder, exist_ok=True)
        path = os.path.join(dump_folder, "metrics.jsonl")
        kept = _rows_up_to(path, resume_step) if resume_step is not None and os.path.isfile(path) else []
        self.earlier = _training_rows(kept)
        """The training steps logged before the resume (read back from the rows kept)."""
        self.jsonl = open(path, "w")
        self.jsonl.writelines(kept)
        self.jsonl.flush()
        if enable_tensorboard:
            from torch.utils.tensorboard.writer import FileWriter

            path = os.path.join(dump_folder, tb_folder)
            os.makedirs(path, exist_ok=True)
            # One event of all the step's scalars (add_scalar makes one per
            # scalar: ~5 ms for a step's 70, on the trainer's thread), flushed
            # by the writer's own thread every few seconds (a flush per step
            # waited for the file write). metrics.jsonl, flushed per step, is
            # the record that survives a kill.
            self.writer = FileWriter(path, flush_secs=TB_FLUSH_SECS)

    def log(self, step: int, m: dict[str, float]) -> None:
        self.history.append(m)
        logger.info(format_line(step, m))
        self.jsonl.write(json.dumps({"step": step, **m}) + "\n")
        self.jsonl.flush()
        self._tensorboard(step, m)

    def _tensorboard(self, step: int, m: dict[str, float]) -> None:
        if self.writer is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in m.items() if isinstance(v, (int, float))]
            self.writer.add_summary(Summary(value=values), step)

    def log_eval(self, step: int, m: dict[str, float]) -> None:
        """An evaluation's metrics at the step whose weights it evaluated: a
        metrics.jsonl row and TensorBoard scalars (``eval/...``), kept out of
        ``history`` (the training steps' record)."""
        self.jsonl.write(json.dumps({"step": step, **m}) + "\n")
        self.jsonl.flush()
        self._tensorboard(step, m)

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def _rows_up_to(path: str, step: int) -> list[str]:
    """metrics.jsonl lines of steps <= ``step`` (a line cut by a kill is dropped)."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except ValueError:
                continue
    return kept


def _training_rows(lines: list[str]) -> list[dict]:
    """The training steps' rows among metrics.jsonl ``lines``, by step: an
    evaluation's row (``log_eval``: only ``eval/...`` keys) is not a step."""
    rows = [json.loads(line) for line in lines]
    rows = [r for r in rows if any(k != "step" and not k.startswith("eval/") for k in r)]
    return sorted(rows, key=lambda r: r.get("step", 0))


def format_line(step: int, m: dict[str, float]) -> str:
    g = lambda k: m.get(k, float("nan"))  # noqa: E731
    return (f"step {step:4d} | reward {g('reward/mean'):.3f} ± {g('reward/std'):.3f} | loss {g('loss'):+.4f} "
            f"| clip {g('clip_fraction'):.3f} | {g('rollout/tokens_per_s'):7.0f} tok/s "
            f"| wait {g('time/wait_s'):.2f}s gen {g('time/generate_s'):.2f}s train {g('time/train_s'):.2f}s push {m.get('time/push_s', 0.0):.2f}s "
            f"| version {int(m.get('weight_version', 0))}")


def window_mean(history: list[dict[str, float]], key: str, first: bool, n: int = 10) -> float:
    rows = history[:n] if first else history[-n:]
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")
