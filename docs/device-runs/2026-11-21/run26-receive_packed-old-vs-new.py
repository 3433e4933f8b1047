"""GPU check of server_vllm.receive_packed over NCCL: rank 0 (cuda:0) sends,
rank 1 (cuda:1) receives from a worker thread whose current device is cuda:0.
A) correctness: mixed dtypes, unaligned offsets, several chunks, while another
   thread runs matmuls on the receiver's default stream; B) timing vs raw NCCL
   and the previous implementation (HEAD), 8B-like metadata."""
import concurrent.futures
import importlib.util
import os
import statistics
import sys
import threading
import time

import torch

from torchtitan_grpo.inference import server_vllm as new
from torchtitan_grpo.weight_sync.buckets import TensorSpec, pack, plan_packed_chunks
from torchtitan_grpo.weight_sync.group import init_weight_group

spec = importlib.util.spec_from_file_location("old_server_vllm", os.path.join(os.path.dirname(__file__), "old_server_vllm.py"))
old = sys.modules["old_server_vllm"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

rank, port = int(sys.argv[1]), int(sys.argv[2])
CPU = os.environ.get("DRY_CPU") == "1"  # a gloo dry run of part A on a machine without GPUs
dev = torch.device("cpu") if CPU else torch.device(f"cuda:{rank}")
group = init_weight_group("127.0.0.1", port, rank, 2, "gloo" if CPU else "nccl", "gpu-packed", 300,
                          device=None if CPU else dev)
worker = concurrent.futures.ThreadPoolExecutor(1)  # like the server's transfer thread (current device cuda:0)


def handshake() -> None:
    group.broadcast(torch.zeros(1, device=dev), src=1)


def mixed(seed: int, n: int = 80) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        dt = [torch.bfloat16, torch.float32, torch.uint8, torch.int64, torch.float16][int(torch.randint(0, 5, (1,), generator=g))]
        shape = [int(torch.randint(1, 3000, (1,), generator=g))] + ([int(torch.randint(1, 40, (1,), generator=g))] if i % 3 == 0 else [])
        t = torch.randint(0, 255, shape, dtype=torch.uint8, generator=g) if dt == torch.uint8 else \
            torch.randint(-(2**40), 2**40, shape, generator=g) if dt == torch.int64 else (torch.randn(shape, generator=g) * 10).to(dt)
        out.append((f"t{i}.{dt}".replace("torch.", ""), t))
    return out


def qwen3_8b_specs(odd_first: bool) -> list[TensorSpec]:
    specs = [TensorSpec("pad.uint8", torch.uint8, (1,))] if odd_first else []
    specs.append(TensorSpec("model.embed_tokens.weight", torch.bfloat16, (151936, 4096)))
    layer = [("input_layernorm.weight", (4096,)), ("self_attn.q_proj.weight", (4096, 4096)),
             ("self_attn.k_proj.weight", (1024, 4096)), ("self_attn.v_proj.weight", (1024, 4096)),
             ("self_attn.o_proj.weight", (4096, 4096)), ("self_attn.q_norm.weight", (128,)),
             ("self_attn.k_norm.weight", (128,)), ("post_attention_layernorm.weight", (4096,)),
             ("mlp.gate_proj.weight", (12288, 4096)), ("mlp.up_proj.weight", (12288, 4096)),
             ("mlp.down_proj.weight", (4096, 12288))]
    for i in range(36):
        specs += [TensorSpec(f"model.layers.{i}.{n}", torch.bfloat16, s) for n, s in layer]
    specs += [TensorSpec("model.norm.weight", torch.bfloat16, (4096,)),
              TensorSpec("lm_head.weight", torch.bfloat16, (151936, 4096))]
    return specs


def busy(stop: threading.Event) -> None:
    a = torch.randn(2048, 2048, device=dev)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a) * 0.5
        torch.cuda.synchronize(dev)


# ---- A) correctness --------------------------------------------------------
for rep, buf_bytes in enumerate([1 << 20, 777_777, 50_000, 1 << 30]):
    named = mixed(rep)
    specs = [TensorSpec.of(n, t) for n, t in named]
    chunks = plan_packed_chunks(specs, buf_bytes)
    if rank == 0:
        tensors = {n: t.to(dev) for n, t in named}
        handshake()
        for chunk in chunks:
            group.broadcast(pack([tensors[s.name] for s in chunk]), src=0)
        continue
    stop = threading.Event()
    bg = threading.Thread(target=busy, args=(stop,)) if not CPU else threading.Thread(target=lambda: None)
    bg.start()
    handshake()
    got = worker.submit(new.receive_packed, group, specs, buf_bytes, 2).result()
    stop.set()
    bg.join()
    views = copies = 0
    for (n, sent), (m, t) in zip(named, got):
        assert n == m and t.dtype == sent.dtype and t.shape == sent.shape and t.is_contiguous() and t.device == dev, n
        assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), n
    for chunk in chunks:
        ptrs = {}
        pos = 0
        for s in chunk:
            t = dict(got)[s.name]
            if pos % s.itemsize == 0:
                ptrs.setdefault("view", set()).add(t.untyped_storage().data_ptr())
                views += 1
            else:
                copies += 1
                assert t.untyped_storage().nbytes() == s.nbytes
            pos += s.nbytes
        assert len(ptrs.get("view", {0})) == 1
    print(f"A rep {rep}: buffer {buf_bytes} B, {len(chunks)} chunks, {views} views, {copies} copies: bytes OK", flush=True)
    del got

# ---- B) timing ---------------------------------------------------------------
if CPU:
    sys.exit(0)
def raw(specs, buffer_bytes):
    chunks = plan_packed_chunks(specs, buffer_bytes)
    main = torch.cuda.current_stream(dev)
    bufs = []
    for c in chunks:
        bufs.append(torch.empty(sum(s.nbytes for s in c), dtype=torch.uint8, device=dev))
        group.broadcast(bufs[-1], src=0, stream=main, wait=False)
    main.synchronize()
    return bufs


for odd_first in (False, True):
    for buffer_bytes in (4 << 30, 1 << 30):
        specs = qwen3_8b_specs(odd_first)
        chunks = plan_packed_chunks(specs, buffer_bytes)
        modes = {"raw": lambda: raw(specs, buffer_bytes),
                 "old": lambda: old.receive_packed(group, specs, buffer_bytes, 2),
                 "new": lambda: new.receive_packed(group, specs, buffer_bytes, 2)}
        order = ["raw", "old", "new"] * 6
        if rank == 0:
            bufs = [torch.empty(sum(s.nbytes for s in c), dtype=torch.uint8, device=dev) for c in chunks]
            s = torch.cuda.Stream(dev)
            for _ in order:
                handshake()
                for b in bufs:
                    group.broadcast(b, src=0, stream=s, wait=False)
                s.synchronize()
            del bufs
            torch.cuda.empty_cache()
            continue
        times = {m: [] for m in modes}
        peak = {m: 0.0 for m in modes}
        for i, m in enumerate(order):
            handshake()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            out = worker.submit(modes[m]).result()
            times[m].append((time.perf_counter() - t0) * 1e3)
            peak[m] = max(peak[m], (torch.cuda.max_memory_allocated(dev) - base) / 2**30)
            del out
        total = sum(s.nbytes for s in specs) / 2**30
        line = ", ".join(f"{m} {statistics.median(v[1:]):.1f} ms (min {min(v[1:]):.1f}, peak {peak[m]:.1f} GiB)"
                         for m, v in times.items())
        print(f"B {'u8 first, ' if odd_first else ''}{len(specs)} tensors {total:.1f} GiB, {len(chunks)} chunks of "
              f"{buffer_bytes >> 20} MiB: {line}", flush=True)
        torch.cuda.empty_cache()
group.close()
print("done", rank)
