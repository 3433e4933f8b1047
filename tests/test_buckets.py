"""Bucket planning and byte packing (weight_sync/buckets.py)."""

import pytest
import torch

from torchtitan_grpo.weight_sync.buckets import (
    SpecError,
    TensorSpec,
    dtype_from_name,
    dtype_name,
    offsets,
    pack,
    packed_nbytes,
    plan_buckets,
    plan_packed_chunks,
    slots,
    specs_from_lists,
    unpack,
)

torch.set_num_threads(1)


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.int8": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),  # 15 B: odd size
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 B
        "c.fp32": torch.randn(2, 3, generator=g),  # 24 B
        "d.int8": torch.randint(-128, 127, (1,), dtype=torch.int8, generator=g),
        "e.fp32.scalar": torch.tensor(3.5),
        "f.bf16": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    }


def test_dtype_names_roundtrip_and_reject_prefixed():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="bare name 'bfloat16'"):
        dtype_from_name("torch.bfloat16")


def test_dtype_alias_and_garbage():
    # torch.float is an alias of float32: getattr semantics accept it, like SGLang.
    assert dtype_from_name("float") is torch.float32
    for bad in ("nn", "tensor", "bfloat17", ""):
        with pytest.raises(ValueError, match="not a torch dtype"):
            dtype_from_name(bad)


def test_flattened_bucket_roundtrip_mixed_dtypes_is_aligned():
    tensors = _mixed_tensors()
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    buckets = plan_buckets(specs, bucket_bytes=1 << 20)
    assert len(buckets) == 1
    bucket = buckets[0]
    # Largest itemsize first, stable otherwise.
    assert [s.name for s in bucket] == ["c.fp32", "e.fp32.scalar", "b.bf16", "f.bf16", "a.int8", "d.int8"]
    offs = offsets(bucket)
    for spec, off in zip(bucket, offs):
        assert off % spec.itemsize == 0, spec.name
    buf = pack([tensors[s.name] for s in bucket])
    assert buf.dtype == torch.uint8 and buf.numel() == packed_nbytes(bucket) == offs[-1]
    out = unpack(buf, bucket)
    for spec, t in zip(bucket, out):
        ref = tensors[spec.name]
        assert t.dtype == ref.dtype and t.shape == ref.shape
        assert torch.equal(t, ref), spec.name
        assert t.data_ptr() >= buf.data_ptr()  # a view, not a copy
    # The bytes really are a plain concatenation: the first 24 bytes are c.fp32.
    assert torch.equal(buf[:24].view(torch.float32).view(2, 3), tensors["c.fp32"])


def test_unaligned_order_is_rejected_naming_the_tensor_but_copy_works():
    tensors = _mixed_tensors()
    order = ["a.int8", "c.fp32"]  # fp32 at byte 15
    specs = [TensorSpec.of(n, tensors[n]) for n in order]
    buf = pack([tensors[n] for n in order])
    with pytest.raises(ValueError, match="'c.fp32'.*byte 15"):
        unpack(buf, specs)
    out = unpack(buf, specs, copy=True)
    assert torch.equal(out[1], tensors["c.fp32"]) and torch.equal(out[0], tensors["a.int8"])


def test_unpack_checks_total_size():
    specs = [TensorSpec("w", torch.float32, (4,))]
    with pytest.raises(ValueError, match="holds 12 bytes.*'?w'?.*need 16"):
        unpack(torch.zeros(12, dtype=torch.uint8), specs)
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack(torch.zeros(4), specs)


def test_pack_into_preallocated_buffer():
    tensors = _mixed_tensors()
    staging = torch.full((1000,), 0xAB, dtype=torch.uint8)
    view = pack(list(tensors.values()), out=staging)
    assert view.data_ptr() == staging.data_ptr()
    assert view.numel() == sum(t.numel() * t.element_size() for t in tensors.values())
    assert torch.equal(view, pack(list(tensors.values())))
    assert int(staging[view.numel()]) == 0xAB  # untouched beyond the prefix
    with pytest.raises(ValueError, match="holds 10 bytes"):
        pack(list(tensors.values()), out=torch.empty(10, dtype=torch.uint8))


def test_plan_buckets_edge_cases():
    mk = lambda n, numel, dt=torch.float32: TensorSpec(n, dt, (numel,))  # noqa: E731
    assert plan_buckets([], 100) == []
    # exact fit stays in one bucket; one byte over starts a new one
    specs = [mk("a", 10), mk("b", 15)]  # 40 + 60 bytes
    assert [[s.name for s in b] for b in plan_buckets(specs, 100)] == [["a", "b"]]
    assert [[s.name for s in b] for b in plan_buckets(specs, 99)] == [["a"], ["b"]]
    # a tensor larger than the bucket gets its own bucket, neighbours unaffected
    specs = [mk("s1", 2), mk("big", 100), mk("s2", 2), mk("s3", 2)]
    assert [[s.name for s in b] for b in plan_buckets(specs, 32)] == [["s1"], ["big"], ["s2", "s3"]]
    # every tensor appears exactly once, in order across buckets
    specs = [mk(f"t{i}", i + 1, [torch.float32, torch.bfloat16, torch.int8][i % 3]) for i in range(30)]
    buckets = plan_buckets(specs, 64)
    assert sorted(s.name for b in buckets for s in b) == sorted(s.name for s in specs)
    assert all(packed_nbytes(b) <= 64 or len(b) == 1 for b in buckets)
    for b in buckets:
        for spec, off in zip(b, offsets(b)):
            assert off % spec.itemsize == 0
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 0)


def test_plan_packed_chunks_close_after_crossing_tensor():
    mk = lambda n, nbytes: TensorSpec(n, torch.uint8, (nbytes,))  # noqa: E731
    specs = [mk("a", 40), mk("b", 40), mk("c", 40), mk("d", 10)]
    # 40, 80, 120 > 100 -> close after c; d alone
    assert [[s.name for s in c] for c in plan_packed_chunks(specs, 100)] == [["a", "b", "c"], ["d"]]
    # reaching the size exactly does not close (strictly "past")
    assert [[s.name for s in c] for c in plan_packed_chunks(specs, 80)] == [["a", "b", "c"], ["d"]]
    assert [[s.name for s in c] for c in plan_packed_chunks(specs, 79)] == [["a", "b"], ["c", "d"]]
    # huge first tensor closes its chunk immediately; order never changes
    specs = [mk("huge", 500), mk("x", 1), mk("y", 1)]
    assert [[s.name for s in c] for c in plan_packed_chunks(specs, 100)] == [["huge"], ["x", "y"]]
    assert plan_packed_chunks([], 10) == []


def test_packed_chunk_roundtrip_unaligned_needs_copy():
    tensors = _mixed_tensors()
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    for chunk in plan_packed_chunks(specs, 20):
        buf = pack([tensors[s.name] for s in chunk])
        for spec, t in zip(chunk, unpack(buf, chunk, copy=True)):
            assert torch.equal(t, tensors[spec.name])


def test_slots_view_aligned_tensors_and_expose_bytes_of_the_others():
    specs = [TensorSpec("a", torch.bfloat16, (3,)), TensorSpec("b", torch.float32, (2,)),
             TensorSpec("c", torch.uint8, (1,)), TensorSpec("d", torch.float32, ())]
    buf = torch.zeros(packed_nbytes(specs), dtype=torch.uint8)
    a, b, c, d = slots(buf, specs)
    # offsets 0, 6, 14, 15: "b" starts at 6, not a multiple of 4; "d" at 15
    assert (a.dtype, tuple(a.shape)) == (torch.bfloat16, (3,))
    assert (b.dtype, b.numel()) == (torch.uint8, 8)
    assert (c.dtype, tuple(c.shape)) == (torch.uint8, (1,))
    assert (d.dtype, d.numel()) == (torch.uint8, 4)
    a.copy_(torch.tensor([1.0, 2.0, 3.0]))
    b.copy_(torch.tensor([4.0, 5.0]).view(torch.uint8))
    got = unpack(buf, specs, copy=True)
    assert got[0].float().tolist() == [1.0, 2.0, 3.0] and got[1].tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="need"):
        slots(buf[:-1], specs)


def test_specs_from_lists_equal_checked_specs():
    names = ["a", "b", "c", "d"]
    dtypes = ["bfloat16", "float32", "bfloat16", "uint8"]
    shapes = [[2, 3], [], [0], [5]]
    specs = specs_from_lists(names, dtypes, shapes)
    expected = [TensorSpec(n, getattr(torch, d), tuple(sh)) for n, d, sh in zip(names, dtypes, shapes)]
    assert specs == expected and [hash(s) for s in specs] == [hash(s) for s in expected]
    assert [s.nbytes for s in specs] == [12, 4, 0, 5] and all(type(s.shape) is tuple for s in specs)
    assert specs_from_lists([], [], []) == []
    with pytest.raises(ValueError, match="negative"):  # the public constructor still checks
        TensorSpec("x", torch.float32, (2, -1))


@pytest.mark.parametrize("names, dtypes, shapes, field, words", [
    (["a", 3], ["float32"] * 2, [[1], [1]], "names", ["field 'names[1]' must be a string"]),
    (["a", "b"], ["float32", "torch.bfloat16"], [[1], [1]], "dtypes", ["field 'dtypes[1]' (tensor 'b')", "bare name"]),
    (["a", "b"], ["float32", ["float32"]], [[1], [1]], "dtypes", ["field 'dtypes[1]' (tensor 'b')", "string"]),
    (["a", "b"], ["float32", "Tensor"], [[1], [1]], "dtypes", ["field 'dtypes[1]' (tensor 'b')", "not a torch dtype"]),
    (["a", "b"], ["float32"] * 2, [[1], [4, -2]], "shapes", ["field 'shapes[1]' (tensor 'b')", "non-negative"]),
    (["a", "b"], ["float32"] * 2, [[1], [False]], "shapes", ["field 'shapes[1]' (tensor 'b')"]),
    (["a", "b"], ["float32"] * 2, [[1], (1,)], "shapes", ["field 'shapes[1]' (tensor 'b')"]),
    (["a", "b"], ["float32"] * 2, [[1], "1"], "shapes", ["field 'shapes[1]' (tensor 'b')"]),
    (["a", "b"], ["float32"], [[1], [1]], None, ["fields 'names', 'dtypes' and 'shapes' differ in length (2, 1, 2)"]),
])
def test_specs_from_lists_name_the_bad_field(names, dtypes, shapes, field, words):
    with pytest.raises(SpecError) as e:
        specs_from_lists(names, dtypes, shapes)
    assert e.value.field == field
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_specs_from_lists_field_names_and_empty_names():
    fields, prefix = ("names", "dtype_names", "shapes"), "update_info."
    assert specs_from_lists([""], ["float32"], [[1]])[0].name == ""
    with pytest.raises(SpecError, match=r"'update_info\.names\[0\]' must be a non-empty string") as e:
        specs_from_lists([""], ["float32"], [[1]], fields, prefix, empty_names=False)
    assert e.value.field == "update_info.names"
    with pytest.raises(SpecError, match=r"'update_info\.dtype_names\[1\]' \(tensor 'y'\)") as e:
        specs_from_lists(["x", "y"], ["float32", "torch.float32"], [[1], [1]], fields, prefix)
    assert e.value.field == "update_info.dtype_names"
    with pytest.raises(SpecError, match=r"'update_info\.shapes\[0\]'") as e:
        specs_from_lists(["x"], ["float32"], [[None]], fields, prefix)
    assert e.value.field == "update_info.shapes"


def test_slots_are_typed_views_of_exactly_their_bytes_at_any_storage_offset():
    """``slots`` (one ``as_strided`` per tensor on a per-dtype view): every
    typed slot is contiguous, of its spec's dtype and shape, and aliases
    exactly its bytes of the buffer, for mixed itemsizes, empty and scalar
    tensors, and buffers that start at an odd byte of their storage; a slot
    that cannot be typed there is its raw bytes."""
    import random

    rng = random.Random(1)
    dtypes = [torch.bfloat16, torch.float32, torch.uint8, torch.float64, torch.int16]
    typed = 0
    for _ in range(500):
        specs = [TensorSpec(f"t{i}", rng.choice(dtypes), tuple(rng.choice([0, 1, 2, 3, 5])
                                                               for _ in range(rng.randint(0, 3))))
                 for i in range(rng.randint(0, 8))]
        base, extra = rng.choice([0, 1, 2, 4, 8]), rng.choice([0, 3])
        storage = torch.randint(0, 255, (base + packed_nbytes(specs) + extra,), dtype=torch.uint8)
        buf = storage[base:]
        pos = 0
        for spec, slot in zip(specs, slots(buf, specs)):
            raw = buf[pos : pos + spec.nbytes]
            pos += spec.nbytes
            if slot.dtype != spec.dtype:
                assert (base + pos - spec.nbytes) % spec.itemsize and torch.equal(slot, raw)
                continue
            assert tuple(slot.shape) == spec.shape and slot.is_contiguous()
            if slot.numel():
                typed += 1
                assert slot.data_ptr() == raw.data_ptr()
                assert torch.equal(slot.reshape(-1).view(torch.uint8), raw)
    assert typed > 500
