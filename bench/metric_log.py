"""What logging one step's metrics costs the trainer's thread (CPU).

    python bench/metric_log.py [--steps 200] [--metrics 70]

Rows, each timed over the same steps of the same metrics dict:

  jsonl-only          metrics.jsonl and the console line, no TensorBoard
  tb-summary          + one TensorBoard event holding the step's scalars
                      (what MetricLogger does)
  tb-add-scalar-flush + TensorBoard the way it was done before: one
                      SummaryWriter.add_scalar per metric, then flush()
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_grpo.metrics import MetricLogger  # noqa: E402


class _AddScalarFlush(MetricLogger):
    """The previous TensorBoard path, kept here only as the baseline."""

    def __init__(self, folder: str):
        super().__init__(folder, enable_tensorboard=False)
        from torch.utils.tensorboard import SummaryWriter

        self.sw = SummaryWriter(os.path.join(folder, "tb"))

    def log(self, step: int, m: dict) -> None:
        super().log(step, m)
        for k, v in m.items():
            self.sw.add_scalar(k, v, step)
        self.sw.flush()

    def close(self) -> None:
        super().close()
        self.sw.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--metrics", type=int, default=70, help="scalars per step (a GRPO step logs about 70)")
    args = ap.parse_args()
    logging.getLogger("torchtitan_grpo").setLevel(logging.WARNING)  # the console line is not what is timed
    metrics = {f"group/metric_{i}": float(i) / 7 for i in range(args.metrics)}
    rows = {
        "jsonl-only": lambda d: MetricLogger(d, enable_tensorboard=False),
        "tb-summary": lambda d: MetricLogger(d, enable_tensorboard=True),
        "tb-add-scalar-flush": _AddScalarFlush,
    }
    print(f"| row | median ms per step | mean ms | p90 ms |  ({args.steps} steps x {args.metrics} scalars)")
    print("| --- | ---: | ---: | ---: |")
    for name, make in rows.items():
        with tempfile.TemporaryDirectory() as d:
            log = make(d)
            times = []
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                log.log(step, metrics)
                times.append(time.perf_counter() - t0)
            log.close()
        times.sort()
        print(f"| {name} | {1e3 * statistics.median(times):.2f} | {1e3 * statistics.mean(times):.2f} | "
              f"{1e3 * times[int(0.9 * len(times))]:.2f} |")


if __name__ == "__main__":
    main()
