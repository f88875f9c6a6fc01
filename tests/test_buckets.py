"""The bucket plan: a partition of the tensors, bounded, one device and dtype each."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from puredist._buckets import plan_buckets

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@st.composite
def tensor_lists(draw):
    specs = draw(st.lists(st.tuples(st.integers(1, 64), st.sampled_from(DTYPES), st.booleans()), max_size=12))
    tensors = []
    for numel, dtype, contiguous in specs:
        t = torch.zeros(2 * numel, dtype=dtype)
        tensors.append(t if contiguous else t[::2])
    return tensors


@given(tensors=tensor_lists(), bucket_bytes=st.integers(1, 300))
def test_plan_is_a_bounded_partition_by_dtype(tensors, bucket_bytes):
    buckets = plan_buckets(tensors, bucket_bytes)
    flat = [i for b in buckets for i in b.indices]
    assert sorted(flat) == list(range(len(tensors)))  # every tensor exactly once
    for bucket in buckets:
        members = [tensors[i] for i in bucket.indices]
        assert len({(t.device, t.dtype) for t in members}) == 1  # no promotion
        assert list(bucket.indices) == sorted(bucket.indices)  # order kept
        sizes = [t.numel() * t.element_size() for t in members]
        if bucket.staged:
            assert bucket.nbytes == sum(sizes)
            assert sum(sizes) <= bucket_bytes or len(members) == 1
        else:
            assert len(members) == 1 and members[0].is_contiguous() and bucket.nbytes == 0


def test_large_contiguous_tensors_are_reduced_in_place_and_small_ones_packed():
    big, small_a, small_b = torch.zeros(1000), torch.zeros(10), torch.zeros(10)
    buckets = plan_buckets([small_a, big, small_b], bucket_bytes=400)
    assert [(b.indices, b.staged) for b in buckets] == [((1,), False), ((0, 2), True)]


def test_tensors_of_a_mebibyte_are_never_copied_even_when_a_bucket_would_hold_them():
    mib_tensor = torch.zeros(2**18)  # 1 MiB of fp32
    strided = torch.zeros(2**19)[::2]  # 1 MiB too, but not contiguous
    buckets = plan_buckets([torch.zeros(4), mib_tensor, strided], bucket_bytes=2**24)
    assert [(b.indices, b.staged) for b in buckets] == [((1,), False), ((0, 2), True)]
