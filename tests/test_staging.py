"""The Pusher's snapshot into its staging buffers (no replicas, no servers):
every tensor lands at its place in the bucket layout of each protocol, cast
or not, and a buffer being rewritten is never handed to a sender."""

import pytest
import torch

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.group_push import GroupPush
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig, PushError
from torchtitan_grpo.weight_sync.transport import Replica


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _tensors() -> dict[str, torch.Tensor]:
    """Mixed itemsizes and odd sizes, so packed vLLM chunks have unaligned offsets."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.index": torch.arange(3, dtype=torch.int64),
        "d.mask": torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8),
        "e.scale": torch.tensor(2.5),
        "f.weight": torch.randn(4, 3, generator=g),
        "g.weight": torch.randn(5, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_snapshot_places_every_tensor(loop, protocol, dtype):
    tensors = _tensors()
    cfg = PushConfig(protocol=protocol, dtype=dtype, bucket_bytes=40, packed_buffer_bytes=30)
    p = Pusher(loop, [], cfg, torch.device("cpu"))
    p.push(tensors, version=1, wait=False)
    staged = p.staging.latest
    assert staged.version == 1 and len(p.staging.plan) > 1
    unaligned = 0
    for bucket, buf in zip(p.staging.plan, staged.buffers):
        unaligned += sum(s.dtype != slot.dtype for s, slot in zip(bucket, bk.slots(buf, bucket)))
        for spec, got in zip(bucket, bk.unpack(buf, bucket, copy=True)):
            t = tensors[spec.name]
            want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            assert got.dtype == want.dtype and torch.equal(got, want), spec.name
    # vLLM's chunks keep the tensors' order, so with mixed itemsizes some
    # offsets are unaligned (the raw-bytes path); SGLang's buckets never are.
    assert (unaligned > 0) is (protocol == "vllm")
    # A new version overwrites the same buffer (no sender holds it).
    tensors["a.weight"].add_(1.0)
    p.push(tensors, version=2, wait=False)
    assert p.staging.latest is staged and staged.version == 2
    got = dict(zip([s.name for b in p.staging.plan for s in b],
                   [t for b, buf in zip(p.staging.plan, staged.buffers) for t in bk.unpack(buf, b, copy=True)]))
    want = tensors["a.weight"].to(dtype) if dtype is not None else tensors["a.weight"]
    assert torch.equal(got["a.weight"], want)


def test_buffer_being_rewritten_is_not_taken(loop):
    """The newest staged version may be overwritten by the next snapshot when
    no sender has taken it yet; while that copy runs no sender may take it
    (it would send a mix of two versions under the older one's number)."""
    tensors = _tensors()
    p = Pusher(loop, [], PushConfig(num_staging_buffers=2), torch.device("cpu"))
    busy, idle = Replica("http://busy"), Replica("http://idle")
    busy.version = idle.version = 0
    p.push(tensors, version=1, wait=False)
    first = p.staging.take(busy)  # a sender sending version 1 holds the first buffer
    assert first is not None and first.version == 1
    p.push(tensors, version=2, wait=False)  # into the second buffer
    second = p.staging.latest
    assert second is not first and second.version == 2
    # Version 3 begins: the only free buffer is the second one, not yet taken.
    assert p.staging.free_buffer() is second
    assert p.staging.take(idle) is None
    p.staging.stage(second, tensors)
    with p.staging.lock:
        second.version = 3
    assert p.staging.take(idle) is second


def test_a_version_is_handed_out_while_staged_and_read_only_once_written(loop, monkeypatch):
    """A push that waits (sync mode) hands its version to the senders before
    the trainer has staged it (their HTTP control plane runs meanwhile);
    whatever reads its bytes first waits for ``written``, and then reads this
    version's bytes, not the previous one's still in the buffer. A push that
    does not wait (async) hands it out only once staged."""
    import threading

    tensors = _tensors()
    p = Pusher(loop, [], PushConfig(bucket_bytes=40), torch.device("cpu"))
    p.push(tensors, version=1, wait=False)
    staged = p.staging.latest
    r = Replica("http://r")
    r.version = 1
    new = {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}
    seen, reader_done, stage_real = [], threading.Event(), p.staging.stage
    read: dict[str, torch.Tensor] = {}

    def reader(s):
        s.await_written()
        for bucket, buf in zip(s.plan, s.buffers):
            read.update(zip([b.name for b in bucket], bk.unpack(buf, bucket, copy=True)))
        reader_done.set()

    def stage(s, t):
        taken = p.staging.take(r)  # what a woken sender does before the trainer has staged
        seen.append((taken is s, s.version, s.written.is_set()))
        threading.Thread(target=reader, args=(taken,), daemon=True).start()
        assert not reader_done.wait(0.2)  # still waiting: nothing is written yet
        stage_real(s, t)

    monkeypatch.setattr(p.staging, "stage", stage)
    p.push(new, version=2, wait=True)  # no replicas: nothing to wait for after the snapshot
    assert seen == [(True, 2, False)]
    assert p.staging.latest is staged  # version 1's buffer, rewritten: stale bytes were there to be read
    assert reader_done.wait(10)
    for name, want in new.items():
        assert torch.equal(read[name], want), name

    # Async: nothing to take while the trainer stages; then version 3, written.
    with p.staging.lock:
        staged.users -= 1  # the reader's transfer of version 2 is over
    r.version = 2
    taken_async = []

    def stage_async(s, t):
        taken_async.append(p.staging.take(r))
        stage_real(s, t)

    monkeypatch.setattr(p.staging, "stage", stage_async)
    p.push(new, version=3, wait=False)
    assert taken_async == [None]
    got = p.staging.take(r)
    assert got.version == 3 and got.written.is_set()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_waited_push_sends_its_first_bucket_while_the_rest_is_staged(loop, monkeypatch, protocol):
    """In a push that waits, a sender broadcasts bucket 0 as soon as the
    trainer has queued its copies, not after the whole snapshot; each bucket
    still goes out with this version's bytes."""
    import threading

    p = Pusher(loop, [], PushConfig(bucket_bytes=40, packed_buffer_bytes=40, protocol=protocol),
               torch.device("cpu"))
    r = Replica("http://r")
    r.version = 0
    sent: list[torch.Tensor] = []
    first_sent = threading.Event()

    class Group:  # what a replica's WeightGroup is to ``broadcast_all``
        def broadcast(self, buf, src, stream=None, wait=True):
            sent.append(buf.clone())
            first_sent.set()

    r.group = Group()
    stage_real, early, taken = p.staging.stage, [], []

    def stage(s, t):
        taken.append(p.staging.take(r))
        sender = threading.Thread(target=GroupPush.broadcast_all,
                                  args=(r, taken[0], list(range(len(s.plan))), threading.Event()))
        queued_real = s.bucket_queued

        def queued(k):
            queued_real(k)
            if k == 0:  # the trainer's thread, before it queues bucket 1
                early.append(first_sent.wait(10))

        monkeypatch.setattr(s, "bucket_queued", queued)
        sender.start()
        stage_real(s, t)
        sender.join(10)

    monkeypatch.setattr(p.staging, "stage", stage)
    p.push(_tensors(), version=1, wait=True)
    assert taken[0] is p.staging.latest and len(taken[0].plan) > 2
    assert early == [True], "bucket 0 was not sent before bucket 1 was staged"
    assert len(sent) == len(taken[0].plan)
    for got, buf in zip(sent, taken[0].buffers):
        assert torch.equal(got, buf)


def test_a_snapshot_that_fails_is_withdrawn_and_its_sender_told(loop, monkeypatch):
    """The trainer's staging raises: push() raises it; a version no sender
    took is never handed out (async) or withdrawn (sync), and a sender that
    took it gets a PushError naming the cause instead of waiting for it forever."""
    import threading

    p = Pusher(loop, [], PushConfig(bucket_bytes=40), torch.device("cpu"))
    r = Replica("http://r")
    r.version = 0

    def broken(s, t):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(p.staging, "stage", broken)
    for wait in (False, True):  # never published / published, then withdrawn
        with pytest.raises(RuntimeError, match="copy failed"):
            p.push(_tensors(), version=1, wait=wait)
        assert p.staging.take(r) is None

    errors, taken = [], []

    def broken_after_take(s, t):
        taken.append(p.staging.take(r))
        raise RuntimeError("copy failed again")

    def sender(s):
        try:
            s.await_written()
        except PushError as e:
            errors.append(str(e))

    monkeypatch.setattr(p.staging, "stage", broken_after_take)
    with pytest.raises(RuntimeError, match="copy failed again"):
        p.push(_tensors(), version=2, wait=True)
    t = threading.Thread(target=sender, args=(taken[0],))
    t.start()
    t.join(10)
    assert errors == ["the trainer's snapshot of version 2 failed: RuntimeError: copy failed again"]
    stop = threading.Event()
    stop.set()
    taken[0].written.clear()
    taken[0].await_written(stop)  # an abandoned transfer stops waiting without an error


def test_other_tensors_get_a_new_plan_and_new_buffers(loop):
    """Not what a training run does (its tensors never change), but a push of
    other tensors must still stage them whole, in buffers of their own layout."""
    p = Pusher(loop, [], PushConfig(bucket_bytes=40), torch.device("cpu"))
    p.push(_tensors(), version=1, wait=False)
    first = p.staging.latest
    other = {"x.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    p.push(other, version=2, wait=False)
    staged = p.staging.latest
    assert staged is not first and staged.plan is p.staging.plan and p.staging.buffers == [staged]
    (bucket,) = staged.plan
    (got,) = bk.unpack(staged.buffers[0], bucket, copy=True)
    assert torch.equal(got, other["x.weight"]) and p.bytes_per_version == 48


def test_uploader_alternates_buffers_and_prefetches_the_next_bucket():
    """staging "host": bucket k is sent from upload buffer k % 2 while bucket
    k+1 is uploaded into the other one, so what is sent is still bucket k's
    bytes after the next upload started; a transfer abandoned after one
    bucket leaves nothing stale for the next."""
    from torchtitan_grpo.weight_sync.upload import Uploader

    up = Uploader(torch.device("cpu"), 10)
    old = [torch.full((n,), 100 + k, dtype=torch.uint8) for k, n in enumerate([10, 7, 10, 3])]
    up.begin(old, None)
    assert torch.equal(up.take(0, None), old[0])
    up.sent(0, None)  # bucket 1 uploaded, then the transfer is abandoned
    host = [torch.full((n,), k + 1, dtype=torch.uint8) for k, n in enumerate([10, 7, 10, 3])]
    up.begin(host, None)
    for k in range(len(host)):
        t = up.take(k, None)
        assert t.data_ptr() == up.slots[k % 2].data_ptr() and t.numel() == host[k].numel()
        up.sent(k, None)  # bucket k+1 now in the other buffer
        assert torch.equal(t, host[k]), k
    with pytest.raises(ValueError, match="11 bytes does not fit the upload buffers of 10"):
        up.begin([torch.zeros(11, dtype=torch.uint8)], None)


def test_staging_must_be_device_or_host(loop):
    with pytest.raises(ValueError, match='staging must be "device" or "host"'):
        Pusher(loop, [], PushConfig(staging="gpu"), torch.device("cpu"))


def test_staging_buffer_that_cannot_be_allocated_names_the_keys(loop, monkeypatch):
    """Out of memory (GPU, or pinned host memory) at the first push: an error
    that says what was asked for and which keys change it, not a bare OOM."""
    p = Pusher(loop, [], PushConfig(backend="nccl", bucket_bytes=40, num_staging_buffers=2), torch.device("cpu"))
    real_empty = torch.empty

    def empty(*a, **k):
        if k.get("dtype") == torch.uint8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB\nmore lines")
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(PushError, match=r"staging buffer 1 of 2 \(0\.00 GB of cpu memory\) could not be allocated: "
                                        r"OutOfMemoryError: CUDA out of memory\. Tried to allocate 16\.00 GiB; lower "
                                        r"weight_sync\.num_staging_buffers or set weight_sync\.staging = \"host\""):
        p.push(_tensors(), version=1, wait=False)
    # gloo and disk stage in host memory whatever weight_sync.staging says: it is not offered.
    g = Pusher(loop, [], PushConfig(backend="gloo", bucket_bytes=40, num_staging_buffers=2), torch.device("cpu"))
    with pytest.raises(PushError, match=r"could not be allocated: OutOfMemoryError: CUDA out of memory\. Tried to "
                                        r"allocate 16\.00 GiB; lower weight_sync\.num_staging_buffers$"):
        g.push(_tensors(), version=1, wait=False)


@pytest.mark.parametrize("backend,staging,on_gpu", [
    ("nccl", "device", False), ("nccl", "host", True), ("gloo", "device", True), ("gloo", "host", True),
    ("disk", "device", True),
])
def test_host_sent_transports_stage_asynchronously_from_a_gpu(loop, backend, staging, on_gpu):
    """gloo and disk read the snapshot from host memory: from a GPU it goes to
    pinned memory beside the next step (the next optimizer step waits for it
    on the GPU, see DirectPush) instead of a copy that holds the trainer's
    thread. On a CPU trainer there is nothing to wait for."""
    for device, expected in ((torch.device("cuda", 0), on_gpu), (torch.device("cpu"), False)):
        p = Pusher(loop, [], PushConfig(backend=backend, staging=staging), device)
        assert p.stages_async == expected, (device, backend, staging)
