"""The trainer side of vLLM's weight transfer without a server: the packed
receive (chunk buffers, views and copies), the update_info parser's refusals,
the weight group's store, and ``weight_sync/vllm_group.py``'s NCCL rendezvous.

``vllm_group.py`` cannot meet a real vLLM here (no GPU), so its store layout
and collective sequence are checked against a fake vLLM worker written from
the facts in that module's docstring, over a fake NCCL fabric. The routes
that take these transfers on the built-in server are in test_vllm_protocol.py.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import io
import math
import os
import pickle
import pickletools
import socket
import sys
import threading
import types
from datetime import timedelta

import pytest
import torch

from tests.server_procs import free_port
from torchtitan_grpo.fleet import vllm
from torchtitan_grpo.server.receive.packed import receive_packed
from torchtitan_grpo.server.vllm_http import VLLMError
from torchtitan_grpo.server.routes.vllm_weights import parse_update_info
from torchtitan_grpo.weight_sync import vllm_group as vg
from torchtitan_grpo.weight_sync.buckets import TensorSpec, plan_packed_chunks
from torchtitan_grpo.weight_sync.group import init_weight_group, master_store

torch.set_num_threads(1)


# --------------------------------------------------------------------------- #
# The packed receive and the update_info parser, without a server
# --------------------------------------------------------------------------- #


def _gloo_pair(group_name: str) -> tuple:
    """(trainer rank 0, server rank 1) of a fresh two-rank gloo group, hosted
    on a store the OS gave a port (as the pusher does)."""
    store = master_store("127.0.0.1", 2, 30)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        peer = ex.submit(init_weight_group, "127.0.0.1", store.port, 1, 2, "gloo", group_name, 30)
        mine = init_weight_group("127.0.0.1", 0, 0, 2, "gloo", group_name, 30, store=store)
        return mine, peer.result(timeout=30)


def test_master_store_listens_before_the_join_on_a_port_the_os_picked():
    """The pusher's store listens on its port before that port is sent to a
    replica (no probed-free port to lose in between); only rank 0 hosts."""
    store = master_store("127.0.0.1", 2, 10)
    assert store.port > 0
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass  # already listening
    with pytest.raises(ValueError, match="rank 0"):
        init_weight_group("127.0.0.1", store.port, 1, 2, "gloo", "not-mine", 10, store=store)
    trainer, server = _gloo_pair("os-port")
    try:
        t = torch.zeros(3)
        got = concurrent.futures.ThreadPoolExecutor(1).submit(server.broadcast, t, 0)
        trainer.broadcast(torch.tensor([1.0, 2.0, 3.0]), src=0)
        got.result(timeout=60)
        assert t.tolist() == [1.0, 2.0, 3.0]
    finally:
        trainer.close()
        server.close()


def test_receive_packed_views_aligned_tensors_and_copies_the_rest():
    """Each chunk lands in a buffer of its own; tensors at itemsize-aligned
    offsets come back as views of it, the others (bf16 then fp32 makes them)
    as copies of their own, and every one is adopted by ``install_weights``."""
    from torchtitan_grpo.server.engine.weights import install_weights

    g = torch.Generator().manual_seed(5)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 100).to(dtype)

    named = [  # name: chunk, byte offset in it, aligned?
        ("c1.bf16", rand(3, dtype=torch.bfloat16)),  # 1 @0 view
        ("c1.fp32", rand(2)),  # 1 @6 copy
        ("c1.int64", torch.randint(-9, 9, (3,), generator=g)),  # 1 @14 copy; 38 B > 32 closes chunk 1
        ("c2.fp32", rand(4)),  # 2 @0 view
        ("c2.uint8", torch.randint(0, 255, (1,), dtype=torch.uint8, generator=g)),  # 2 @16 view
        ("c2.bf16", rand(2, 2, dtype=torch.bfloat16)),  # 2 @17 copy
        ("c2.fp32.scalar", rand()),  # 2 @25 copy
        ("c2.bf16.last", rand(8, dtype=torch.bfloat16)),  # 2 @29 copy; 45 B closes chunk 2
        ("c3.fp32", rand(2, 3)),  # 3 @0 view
        ("c3.bf16", rand(1, dtype=torch.bfloat16)),  # 3 @24 view
        ("c3.fp32.b", rand(1)),  # 3 @26 copy
        ("c3.empty", rand(0, 4)),  # 3 @30 copy (of nothing)
    ]
    aligned = {"c1.bf16", "c2.fp32", "c2.uint8", "c3.fp32", "c3.bf16"}
    specs = [TensorSpec.of(n, t) for n, t in named]
    chunks = plan_packed_chunks(specs, 32)
    assert [[s.name[:2] for s in c] for c in chunks] == [["c1"] * 3, ["c2"] * 5, ["c3"] * 4]
    trainer, server = _gloo_pair("packed-views")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            got = ex.submit(receive_packed, server, specs, 32, 1)
            assert vg.send_weights(trainer, named, packed=True, packed_buffer_size_bytes=32) == 3
            got = got.result(timeout=30)
    finally:
        trainer.close()
        server.close()

    assert [n for n, _ in got] == [n for n, _ in named]
    storage = {}  # name -> (data_ptr, nbytes) of the storage behind it
    for (name, sent), (_, t) in zip(named, got):
        assert t.dtype == sent.dtype and t.shape == sent.shape and t.is_contiguous(), name
        assert torch.equal(t.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), name
        storage[name] = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    for chunk in chunks:
        views = {storage[s.name] for s in chunk if s.name in aligned}
        assert len(views) == 1, chunk  # one buffer per chunk, exactly its size
        assert views.pop()[1] == sum(s.nbytes for s in chunk)
    assert len({storage[n] for n in aligned}) == len(chunks)
    buffers = {storage[n][0] for n in aligned}
    for name in {n for n, _ in named} - aligned:
        assert storage[name][0] not in buffers and storage[name][1] == dict(named)[name].nbytes, name

    params = {n: torch.zeros_like(t) for n, t in named}
    install_weights(params, got)
    for name, t in got:
        assert params[name].data_ptr() == t.data_ptr(), name  # adopted, not copied


def _parse_error(update_info: dict) -> VLLMError:
    with pytest.raises(VLLMError) as e:
        parse_update_info(update_info, None)
    return e.value


@pytest.mark.parametrize("field, value, param, words", [
    ("names", ["model.norm.weight", 7], "update_info.names", ["'update_info.names[1]'", "string"]),
    ("names", ["model.norm.weight", ""], "update_info.names", ["'update_info.names[1]'", "non-empty"]),
    ("dtype_names", ["float32", "torch.bfloat16"], "update_info.dtype_names",
     ["'update_info.dtype_names[1]'", "'b'", "bare name 'bfloat16'"]),
    ("dtype_names", ["float32", None], "update_info.dtype_names", ["'update_info.dtype_names[1]'", "'b'"]),
    ("shapes", [[64], [2, -1]], "update_info.shapes", ["'update_info.shapes[1]'", "'b'", "non-negative"]),
    ("shapes", [[64], [True]], "update_info.shapes", ["'update_info.shapes[1]'", "'b'"]),
    ("shapes", [[64], [2.0]], "update_info.shapes", ["'update_info.shapes[1]'", "'b'"]),
    ("shapes", [[64]], "update_info", ["differ in length", "(2, 2, 1)"]),
])
def test_update_info_refuses_bad_metadata_naming_the_field(field, value, param, words):
    good = {"names": ["a", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[64], [2, 3]]}
    specs = parse_update_info(good, None)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("a", torch.float32, (64,)), ("b", torch.bfloat16, (2, 3))]
    err = _parse_error({**good, field: value})
    assert err.code == 400 and err.param == param, (err.param, err.message)
    for w in words:
        assert w in err.message, (w, err.message)


# --------------------------------------------------------------------------- #
# vllm_group.py against a fake vLLM worker (facts in that module's docstring)
# --------------------------------------------------------------------------- #


@pytest.fixture
def fake_vllm_module(monkeypatch):
    """vLLM's ncclUniqueId (pynccl_wrapper.py: a ctypes Structure whose one
    field is ``internal: c_byte * 128``) at vLLM's module path, so plain
    ``pickle.loads`` resolves it as a vLLM worker would."""
    module_name, class_name = vg.VLLM_UNIQUE_ID_CLASS
    mod = types.ModuleType(module_name)
    cls = type(class_name, (ctypes.Structure,), {"_fields_": [("internal", ctypes.c_byte * 128)],
                                                 "__module__": module_name})
    mod.ncclUniqueId = cls
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, module_name, mod)
    return cls


def test_unique_id_pickle_interoperates_with_vllm_class(fake_vllm_module):
    raw = bytes(range(128))
    obj = pickle.loads(vg.pickle_unique_id(raw))  # what a vLLM worker does with the store value
    assert type(obj) is fake_vllm_module and bytes(obj) == raw
    assert bytes(bytearray(x & 0xFF for x in obj.internal)) == raw
    # and the other way: a pickle made by vLLM's own class (any protocol) reads back
    theirs = fake_vllm_module()
    ctypes.memmove(ctypes.addressof(theirs), raw, 128)
    for protocol in (2, 3, pickle.DEFAULT_PROTOCOL):
        assert vg.load_unique_id(pickle.dumps(theirs, protocol=protocol)) == raw
    assert vg.load_unique_id(vg.pickle_unique_id(raw)) == raw
    pickletools.dis(vg.pickle_unique_id(raw), out=io.StringIO())  # well-formed
    with pytest.raises(pickle.UnpicklingError):  # a store value never runs anything else
        vg.load_unique_id(pickle.dumps(os.system))
    with pytest.raises(ValueError):
        vg.pickle_unique_id(b"short")


class FakeFabric:
    """An in-process stand-in for NCCL: ranks of one unique id meet at
    barriers, each collective must match in kind, dtype and size on every
    rank (as NCCL requires), broadcast copies from rank 0, all_reduce sums."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.calls: list[tuple] = []
        self.errors: list[str] = []
        self._groups: dict[bytes, dict] = {}
        self._lock = threading.Lock()

    def unique_id(self) -> bytes:
        self.calls.append(("unique_id",))
        return os.urandom(128)

    def init_rank(self, world_size: int, unique_id: bytes, rank: int, device=None):
        self.calls.append(("init_rank", rank, world_size))
        with self._lock:
            g = self._groups.setdefault(unique_id, {"world": world_size, "slots": {},
                                                    "barrier": threading.Barrier(world_size, timeout=self.timeout_s)})
        assert g["world"] == world_size, "ranks disagree on world_size"
        g["barrier"].wait()  # like ncclCommInitRank: returns when all ranks joined
        return (unique_id, rank)

    def _collective(self, comm, kind: str, tensor: torch.Tensor) -> None:
        uid, rank = comm
        g = self._groups[uid]
        self.calls.append((kind, rank, tensor.dtype, tensor.numel()))
        g["slots"][rank] = (kind, tensor.dtype, tensor.numel(), tensor)
        g["barrier"].wait()
        sig = {s[:3] for s in g["slots"].values()}
        if len(sig) != 1:
            self.errors.append(f"mismatched collective: {sorted(map(str, sig))}")
            g["barrier"].abort()
            raise RuntimeError(self.errors[-1])
        result = (sum(s[3] for s in g["slots"].values()) if kind == "all_reduce" else g["slots"][0][3]).clone()
        g["barrier"].wait()
        tensor.copy_(result)
        g["barrier"].wait()

    def all_reduce(self, tensor, comm) -> None:
        self._collective(comm, "all_reduce", tensor)

    def broadcast(self, tensor, comm, stream=None) -> None:
        self._collective(comm, "broadcast", tensor)

    def abort(self, comm) -> None:
        self.calls.append(("abort", comm[1]))


def fake_vllm_worker(fabric: FakeFabric, host: str, port: int, rank: int, world_size: int,
                     specs: list[tuple[str, torch.dtype, list[int]]], packed: bool, buffer_bytes: int) -> dict:
    """One vLLM worker, from the facts: StatelessProcessGroup client store,
    broadcast_obj(src=0) #0 = pickled ncclUniqueId, ncclCommInitRank, warm-up
    all_reduce of zeros(1), then the receive of one update."""
    store = torch.distributed.TCPStore(host, port, world_size, False, timedelta(seconds=20), use_libuv=False)
    uid = bytes(pickle.loads(store.get("broadcast_from/0/0")))
    comm = fabric.init_rank(world_size, uid, rank)
    warm = torch.zeros(1)
    fabric.all_reduce(warm, comm)
    assert warm.item() == 0.0
    got = {}
    if not packed:
        for name, dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            fabric.broadcast(t, comm)
            got[name] = t
        return got
    # packed consumer: add tensors until the running size passes the buffer, then receive that chunk
    pending, size = [], 0
    for i, (name, dtype, shape) in enumerate(specs):
        pending.append((name, dtype, shape, math.prod(shape) * dtype.itemsize))
        size += pending[-1][3]
        if size > buffer_bytes or i == len(specs) - 1:
            buf = torch.empty(size, dtype=torch.uint8)
            fabric.broadcast(buf, comm)
            pos = 0
            for n, d, s, nb in pending:
                got[n] = buf[pos:pos + nb].clone().view(d).view(s)
                pos += nb
            pending, size = [], 0
    return got


@pytest.mark.parametrize("packed, buffer_bytes", [(False, 100), (True, 100), (True, 74)],
                         ids=["per-tensor", "packed", "packed-exact-fill"])
def test_vllm_group_handshake_with_fake_workers(fake_vllm_module, packed, buffer_bytes):
    fabric = FakeFabric()
    port, world = free_port(), 3  # trainer + a TP=2 replica at rank_offset 1
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(5, 3, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.arange(11, dtype=torch.int64)), ("d", torch.randn(40, generator=g))]
    specs = [(n, t.dtype, list(t.shape)) for n, t in named]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        # workers first: they wait for the store and the key, as real ones do
        workers = [ex.submit(fake_vllm_worker, fabric, "127.0.0.1", port, 1 + w, world, specs, packed, buffer_bytes)
                   for w in range(2)]
        group = vg.init_vllm_weight_group("127.0.0.1", port, world, device="cpu", timeout_s=20, nccl=fabric)
        sent = vg.send_weights(group, named, packed, packed_buffer_size_bytes=buffer_bytes)
        results = [w.result(timeout=20) for w in workers]
    assert not fabric.errors
    for got in results:
        assert list(got) == [n for n, _ in named]
        for n, t in named:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # a: 60 B, b: 14 -> 74 (not past 74: stays open), c: 88 -> 162 closes; d: 160 closes
    assert sent == (2 if packed else 4)
    mine = [c for c in fabric.calls if len(c) < 2 or c[1] == 0 or c[0] == "unique_id"]
    assert mine[:3] == [("unique_id",), ("init_rank", 0, world), ("all_reduce", 0, torch.float32, 1)]
    assert [c[0] for c in mine[3:]] == ["broadcast"] * sent
    # the store holds the id under StatelessProcessGroup's key, unprefixed
    client = torch.distributed.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=5), use_libuv=False)
    assert client.check([vg.UNIQUE_ID_KEY]) and vg.UNIQUE_ID_KEY == "broadcast_from/0/0"
    assert len(vg.load_unique_id(client.get(vg.UNIQUE_ID_KEY))) == 128
    group.close()
    assert group.closed and ("abort", 0) in fabric.calls
    with pytest.raises(RuntimeError, match="closed"):
        group.broadcast(torch.zeros(1))


def test_a_trainer_without_the_warmup_deadlocks_the_fake(fake_vllm_module, monkeypatch):
    """The fake is strict enough to catch a skipped warm-up all_reduce."""
    fabric = FakeFabric(timeout_s=3)
    monkeypatch.setattr(vg, "_join", lambda nccl, world, uid, dev: nccl.init_rank(world, uid, 0, dev))
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        worker = ex.submit(fake_vllm_worker, fabric, "127.0.0.1", port, 1, 2, [("a", torch.float32, [4])], False, 0)
        group = vg.init_vllm_weight_group("127.0.0.1", port, 2, device="cpu", timeout_s=10, nccl=fabric)
        with pytest.raises(Exception):
            group.broadcast(torch.ones(4))
        with pytest.raises(Exception):
            worker.result(timeout=60)
    assert fabric.errors and "all_reduce" in fabric.errors[0]


def test_unique_id_rendezvous_needs_no_store():
    fabric = FakeFabric()
    raw, b64 = vg.mint_unique_id_b64(fabric)
    info = vllm.init_weight_transfer_request(2, nccl_unique_id_b64=b64)["init_info"]
    import base64

    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == raw

    def worker():  # vLLM's uid path: decode, ncclCommInitRank, warm-up, receive
        comm = fabric.init_rank(2, base64.b64decode(info["nccl_unique_id_b64"]), 1)
        fabric.all_reduce(torch.zeros(1), comm)
        t = torch.empty(3)
        fabric.broadcast(t, comm)
        return t

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        got = ex.submit(worker)
        group = vg.init_vllm_weight_group_from_unique_id(raw, 2, device="cpu", nccl=fabric)
        group.broadcast(torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(got.result(timeout=60), torch.tensor([1.0, 2.0, 3.0]))
    assert not fabric.errors


def test_post_packed_returns_before_the_bytes_and_wait_delivers_them():
    """``post_packed`` returns once every chunk's receive is posted, before
    the trainer has sent a byte (several gloo receives outstanding, matched
    in order), and ``wait`` delivers every tensor exactly, the unaligned
    copies included."""
    from torchtitan_grpo.server.receive.packed import post_packed

    g = torch.Generator().manual_seed(9)
    named = [("a.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),  # chunk 1 @0
             ("a.fp32", torch.randn(5, generator=g)),  # chunk 1 @6: unaligned, copied out by wait
             ("b.fp32", torch.randn(8, generator=g)),  # chunk 2 @0
             ("c.fp32", torch.randn(4, 2, generator=g))]  # chunk 3 @0
    specs = [TensorSpec.of(n, t) for n, t in named]
    assert len(plan_packed_chunks(specs, 20)) == 3
    trainer, server = _gloo_pair("packed-posted")
    try:
        posted = post_packed(server, specs, 20)  # returns with nothing sent yet
        assert posted.in_flight() and posted.finish is not None
        assert vg.send_weights(trainer, named, packed=True, packed_buffer_size_bytes=20) == 3
        got = posted.wait()
        assert not posted.in_flight()
    finally:
        trainer.close()
        server.close()
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, sent), (_, t) in zip(named, got):
        assert t.dtype == sent.dtype and torch.equal(t, sent), name
