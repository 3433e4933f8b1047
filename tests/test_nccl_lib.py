"""``weight_sync/nccl_lib.py``: the trainer's NCCL calls through ctypes (rank 0
of a real vLLM's weight group).

On CPU the library is a fake made of real ctypes callbacks, so each call goes
through the declared C signatures as it would into libnccl: the unique id by
value, the communicator written through its pointer, the counts, NCCL's
dtype codes, root 0, errors with NCCL's own text. With two GPUs, two
processes form a real communicator and broadcast through it (recorded in
docs/GPU_RUNS.md).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtitan_grpo.weight_sync import nccl_lib
from torchtitan_grpo.weight_sync.nccl_lib import UNIQUE_ID_BYTES, CtypesNccl, UniqueId

P, I32, SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t


class FakeLib:
    """libnccl's six functions as ctypes callbacks that record their arguments."""

    def __init__(self, fail: dict[str, int] | None = None):
        self.calls: list[tuple] = []
        self.fail = fail or {}
        self._keep = []

        def fn(restype, argtypes, body):
            f = ctypes.CFUNCTYPE(restype, *argtypes)(body)
            self._keep.append(f)
            return f

        def rc(name: str) -> int:
            return self.fail.get(name, 0)

        def unique_id(p):
            ctypes.memmove(p[0].internal, bytes(range(UNIQUE_ID_BYTES)), UNIQUE_ID_BYTES)
            self.calls.append(("unique_id",))
            return rc("ncclGetUniqueId")

        def init(pcomm, n, uid, rank):
            pcomm[0] = 0xC0FFEE
            self.calls.append(("init", n, bytes(uid.internal), rank))
            return rc("ncclCommInitRank")

        def all_reduce(send, recv, count, dtype, op, comm, stream):
            self.calls.append(("all_reduce", send, recv, count, dtype, op, comm, stream))
            return rc("ncclAllReduce")

        def broadcast(send, recv, count, dtype, root, comm, stream):
            self.calls.append(("broadcast", send, recv, count, dtype, root, comm, stream))
            return rc("ncclBroadcast")

        def abort(comm):
            self.calls.append(("abort", comm))
            return rc("ncclCommAbort")

        self._text = ctypes.create_string_buffer(b"unhandled system error")  # a static string, as NCCL's
        self.ncclGetErrorString = fn(P, [I32], lambda code: ctypes.addressof(self._text))
        self.ncclGetUniqueId = fn(I32, [ctypes.POINTER(UniqueId)], unique_id)
        self.ncclCommInitRank = fn(I32, [ctypes.POINTER(P), I32, UniqueId, I32], init)
        self.ncclAllReduce = fn(I32, [P, P, SIZE, I32, I32, P, P], all_reduce)
        self.ncclBroadcast = fn(I32, [P, P, SIZE, I32, I32, P, P], broadcast)
        self.ncclCommAbort = fn(I32, [P], abort)


def test_calls_reach_the_library_with_nccls_arguments():
    lib = FakeLib()
    nccl = CtypesNccl(lib)
    uid = nccl.unique_id()
    assert uid == bytes(range(UNIQUE_ID_BYTES))
    comm = nccl.init_rank(3, uid, 0, torch.device("cpu"))
    assert comm == 0xC0FFEE
    assert lib.calls[1] == ("init", 3, uid, 0)  # the whole id, by value

    warm = torch.zeros(1, dtype=torch.float32)
    nccl.all_reduce(warm, comm)
    _, send, recv, count, dtype, op, c, stream = lib.calls[2]
    assert (send, recv, count, dtype, op, c, stream) == (warm.data_ptr(), warm.data_ptr(), 1, 7, 0, 0xC0FFEE, None)

    t = torch.ones(1000, dtype=torch.bfloat16)
    nccl.broadcast(t, comm)
    _, send, recv, count, dtype, root, c, _ = lib.calls[3]
    assert (send, recv, count, dtype, root, c) == (t.data_ptr(), t.data_ptr(), 1000, 9, 0, 0xC0FFEE)
    u8 = torch.zeros(1 << 20, dtype=torch.uint8)
    nccl.broadcast(u8, comm)  # a packed chunk: raw bytes
    assert lib.calls[4][3:5] == (1 << 20, 1)

    nccl.abort(comm)
    assert lib.calls[5] == ("abort", 0xC0FFEE)


def test_an_nccl_error_names_the_call_and_nccls_text():
    nccl = CtypesNccl(FakeLib(fail={"ncclCommInitRank": 2}))
    with pytest.raises(RuntimeError, match=r"ncclCommInitRank failed: NCCL error 2 \(unhandled system error\)"):
        nccl.init_rank(2, bytes(UNIQUE_ID_BYTES), 0, torch.device("cpu"))
    nccl = CtypesNccl(FakeLib(fail={"ncclBroadcast": 3}))
    with pytest.raises(RuntimeError, match="ncclBroadcast failed: NCCL error 3"):
        nccl.broadcast(torch.zeros(4), 1)


def test_refusals_before_any_call():
    lib = FakeLib()
    nccl = CtypesNccl(lib)
    with pytest.raises(ValueError, match="128 bytes, got 16"):
        nccl.init_rank(2, bytes(16), 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="no type for torch.complex64"):
        nccl.broadcast(torch.zeros(4, dtype=torch.complex64), 1)
    with pytest.raises(ValueError, match="contiguous"):
        nccl.broadcast(torch.zeros(4, 4).t(), 1)
    assert lib.calls == []


def test_no_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nccl_lib, "loaded_libnccl", lambda: None)

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(nccl_lib.ctypes, "CDLL", missing)
    with pytest.raises(RuntimeError, match="no NCCL library.*libnccl.so.2"):
        CtypesNccl()


_PEER = textwrap.dedent("""
    import sys, torch
    from torchtitan_grpo.weight_sync.nccl_lib import CtypesNccl
    uid = bytes.fromhex(sys.stdin.readline().strip())
    dev = torch.device("cuda", 1)
    nccl = CtypesNccl()
    comm = nccl.init_rank(2, uid, 1, dev)
    warm = torch.full((1,), 2.0, device=dev)
    nccl.all_reduce(warm, comm)
    t = torch.zeros(3_000_001, dtype=torch.bfloat16, device=dev)
    nccl.broadcast(t, comm)
    print(warm.item(), t.float().sum().item(), t[12345].item(), flush=True)
    nccl.abort(comm)
""")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on a device machine: docs/GPU_RUNS.md)")
def test_two_gpus_form_a_communicator_and_broadcast():
    nccl = CtypesNccl()
    uid = nccl.unique_id()
    peer = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        peer.stdin.write(uid.hex() + "\n")
        peer.stdin.flush()
        dev = torch.device("cuda", 0)
        comm = nccl.init_rank(2, uid, 0, dev)
        warm = torch.full((1,), 1.0, device=dev)
        nccl.all_reduce(warm, comm)
        assert warm.item() == 3.0
        gen = torch.Generator(device=dev).manual_seed(0)
        t = torch.randn(3_000_001, device=dev, generator=gen).to(torch.bfloat16)
        nccl.broadcast(t, comm)
        out, err = peer.communicate(timeout=120)
        assert peer.returncode == 0, err[-2000:]
        got = [float(x) for x in out.split()]
        assert got == [3.0, t.float().sum().item(), t[12345].item()]
        nccl.abort(comm)
    finally:
        if peer.poll() is None:
            peer.kill()
