"""What a run's processes use per trainer step: CPU seconds (Linux
``/proc``) and, on a GPU, the fraction of time a kernel ran (``nvidia-smi``).

On a box where the trainer and the servers share the cores, the overlap of
generation and training can only go as far as the cores allow: a step cannot
take less than (CPU seconds the whole run spends per step) / (cores). On one
GPU shared by two processes, their kernels take turns (no MPS), so a step
cannot take less than the time the GPU was busy in it. The pipelined-loop
benchmark prints that bound beside the issue's ideal, which assumes the two
phases never compete.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import threading

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds of all its threads), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except (OSError, IndexError):
        return None
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, now."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parent[int(entry)] = st[0]
    found, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        found += frontier
    return found


class StepUsageMeter:
    """Polls a growing metrics.jsonl and the CPU time of ``groups`` of
    processes; :meth:`per_step` is each group's CPU seconds per step between
    the first poll that saw ``from_step`` lines and the first poll that saw
    the last line. The trainer's processes are found below ``trainer_root`` once the
    file exists (torchrun starts them late)."""

    def __init__(self, metrics_path: str, from_step: int, server_pids: list[int], trainer_root: int,
                 poll_s: float = 0.05, gpus: tuple[int, ...] = ()) -> None:
        self.path, self.from_step, self.poll_s = metrics_path, from_step, poll_s
        self.server_pids, self.trainer_root = server_pids, trainer_root
        self.trainer_pids: list[int] = []
        self.first: tuple[int, dict[str, float]] | None = None
        self.last: tuple[int, dict[str, float]] | None = None
        self._offset, self._lines = 0, 0
        self.window: list[datetime.datetime] = []  # wall clock at the first and the last poll
        # one sampler per GPU: "gpu_busy" is the first's (the trainer's),
        # "gpu<i>_busy" each other's (the servers' GPUs when they have their own)
        self._gpus = {("gpu_busy" if n == 0 else f"gpu{i}_busy"): GpuBusy(i) for n, i in enumerate(gpus)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()

    def _cpu(self) -> dict[str, float] | None:
        out = {}
        for name, pids in (("trainer", self.trainer_pids), ("servers", self.server_pids)):
            stats = [_stat(p) for p in pids]
            if any(s is None for s in stats):
                return None  # a process has exited: the window is over
            out[name] = sum(s[1] for s in stats)
        return out

    def _count_lines(self) -> int:
        """Lines written so far (reads only what was appended since the last poll)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                new = f.read()
        except OSError:
            return self._lines
        self._offset += len(new)
        self._lines += new.count(b"\n")
        return self._lines

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            n = self._count_lines()
            if n == 0:
                continue
            if not self.trainer_pids:
                self.trainer_pids = descendants(self.trainer_root)
            if n < self.from_step or (cpu := self._cpu()) is None:
                continue
            if self.first is None:
                self.first = (n, cpu)
                self.window = [datetime.datetime.now()] * 2
            elif n > (self.last or self.first)[0]:  # at a new line only: the run's end is not a step
                self.last = (n, cpu)
                self.window[1] = datetime.datetime.now()

    def per_step(self) -> dict[str, float]:
        """CPU seconds per step of each group (empty if the window was too short)."""
        self._stop.set()
        self._thread.join()
        busy = {k: g.busy_fraction(*(self.window or (None, None))) for k, g in self._gpus.items()}
        if self.first is None or self.last is None:
            return {}
        steps = self.last[0] - self.first[0]
        out = {k: (self.last[1][k] - self.first[1][k]) / steps for k in self.first[1]}
        out.update({k: v for k, v in busy.items() if v is not None})
        return out


class GpuBusy:
    """``nvidia-smi`` sampling one GPU's utilisation (the share of each
    ~100 ms in which a kernel ran) until :meth:`busy_fraction` is asked."""

    def __init__(self, index: int, period_ms: int = 100) -> None:
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(index), "--query-gpu=timestamp,utilization.gpu",
                 "--format=csv,noheader,nounits", "-lms", str(period_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def busy_fraction(self, start: datetime.datetime | None, end: datetime.datetime | None) -> float | None:
        """Stops sampling; the mean utilisation of the samples taken between
        ``start`` and ``end`` (None without nvidia-smi, a window or samples)."""
        if self.proc is None:
            return None
        self.proc.terminate()
        out, _ = self.proc.communicate()
        if start is None or end is None:
            return None
        vals = []
        for line in out.splitlines():
            stamp, _, util = line.partition(",")
            try:
                t = datetime.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f")
                if start <= t <= end:
                    vals.append(float(util) / 100.0)
            except ValueError:
                continue
        return sum(vals) / len(vals) if vals else None


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


__all__ = ["GpuBusy", "StepUsageMeter", "cores", "descendants"]
