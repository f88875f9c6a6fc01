"""What averaging accepts: low-precision means that do not overflow, on every path;
aliased, sparse, meta, float8 and expanded tensors refused (naming the leaf and the
reason) before anything is touched; complex tensors averaged."""

import numpy as np
import pytest
import torch

import puredist
from puredist import DistributedCollective, SimulatedCollective
from puredist.classic import PeriodicModelAverager
from workers import run_workers

FP16_MEAN = torch.tensor([40000.0, 30000.0], dtype=torch.float16).float().mean().half()  # 35008, as torch gives


def test_fp16_mean_does_not_overflow_on_the_simulated_backend():
    stacked = torch.tensor([[40000.0], [30000.0]], dtype=torch.float16)
    out = puredist.average(stacked, collective=SimulatedCollective(2))
    assert torch.equal(out, torch.full((2, 1), FP16_MEAN.item(), dtype=torch.float16))


def _fp16_every_path(rank, world_size):
    value = [40000.0, 30000.0][rank]
    functional = torch.full((4,), value, dtype=torch.float16)
    puredist.average_([functional], collective=DistributedCollective())

    classic = torch.nn.Parameter(torch.full((4,), value, dtype=torch.float16))
    classic.grad = torch.zeros_like(classic)
    PeriodicModelAverager(period=2, warmup_steps=0).average_parameters([classic])

    # DiLoCo's first synchronization: global copy 0, local value -> pseudo-gradient -value
    diloco = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=1, comm_dtype=torch.float16)
    local = [torch.zeros(4, dtype=torch.float16)]
    state = diloco.init(local)
    local[0].fill_(value)
    diloco.update_(local, state, collective=DistributedCollective())
    return [t.detach().clone() for t in (functional, classic, local[0])]


def test_fp16_mean_does_not_overflow_on_real_ranks_in_every_path():
    for rank_results in run_workers(_fp16_every_path, 2):
        for tensor in rank_results:
            assert torch.equal(tensor, torch.full((4,), FP16_MEAN.item(), dtype=torch.float16)), tensor


def _refused(params, match, error=ValueError):
    copies = [t.clone() if t.layout == torch.strided and not t.is_meta else t for t in params]
    with pytest.raises(error, match=match):
        puredist.average_(params, collective=SimulatedCollective(2))
    for before, after in zip(copies, params):
        if after.layout == torch.strided and not after.is_meta:
            assert torch.equal(before, after)  # nothing touched


def test_the_same_tensor_twice_is_refused_before_anything_is_touched():
    big = torch.randn(2, 2**18)
    _refused([torch.randn(2, 3), big, big], r"leafs 1 and 2 share memory")
    base = torch.randn(2, 10)
    _refused([base[:, :6], base[:, 4:]], r"leafs 0 and 1 share memory")


@pytest.mark.parametrize(
    "bad, match, error",
    [
        (torch.eye(2).to_sparse(), r"leaf 1 \(shape \(2, 2\).*layout torch.sparse_coo.*only dense", ValueError),
        (torch.zeros(2, 3, device="meta"), r"leaf 1 .*meta tensor: it holds no values", ValueError),
        (torch.zeros(2, 3).to(torch.float8_e4m3fn), r"leaf 1 .*float8.*bf16 or fp16 copy", TypeError),
        (torch.zeros(2, 1).expand(2, 5), r"leaf 1 .*overlapping elements.*strides \(1, 0\)", ValueError),
        (torch.zeros(2, 3, dtype=torch.int32), r"leaf 1 .*int32.*floating-point or complex", TypeError),
    ],
)
def test_unsupported_tensors_are_refused_naming_the_leaf_and_the_reason(bad, match, error):
    _refused([torch.randn(2, 4), bad], match, error)


def test_views_that_interleave_without_a_common_element_are_averaged_and_overlapping_ones_refused():
    # byte ranges overlap in every case; only the elements tell them apart
    base, z = torch.randn(2, 12), torch.randn(2, 5, dtype=torch.complex64)
    cases = [(base[:, :5], base[:, 5:]), (base[:, ::2], base[:, 1::2]), (z.real, z.imag)]
    for views in cases:
        expected = [v.mean(0, keepdim=True).expand_as(v).clone() for v in views]
        puredist.average_(list(views), collective=SimulatedCollective(2))
        assert all(torch.equal(v, e) for v, e in zip(views, expected))
    other = torch.randn(2, 12)
    _refused([other[:, ::2], other[:, ::3]], r"leafs 0 and 1 share memory")  # columns 0 and 6 in both
    # odd columns and 3, 7, 11 share; 2, 6, 10 starts between them and shares with neither
    _refused([other[:, 1::2], other[:, 2::4], other[:, 3::4]], r"leafs 0 and 2 share memory")


def test_an_inference_tensor_is_refused_outside_inference_mode_and_averaged_inside_it():
    with torch.inference_mode():
        made = [torch.randn(2, 4), torch.randn(2, 4)]
    # torch refuses to write an inference tensor outside inference mode: found before any other is averaged
    _refused([torch.randn(2, 4), made[1]], r"leaf 1 .*inference tensor.*inference_mode")
    expected = [t.mean(0, keepdim=True).expand_as(t) for t in made]
    with torch.inference_mode():
        puredist.average_(made, collective=SimulatedCollective(2))
    assert all(torch.equal(t, e) for t, e in zip(made, expected))
    # the same tensors, so the same addresses and metadata, outside the mode again: refused again
    _refused(made, r"leaf 0 .*inference tensor")


def test_a_conjugate_view_is_refused_even_after_its_base_was_averaged():
    z = torch.randn(2, 3, dtype=torch.complex64)
    puredist.average_([z], collective=SimulatedCollective(2))  # its layout is now known (and equal to the view's)
    _refused([torch.randn(2, 4), z.conj()], r"leaf 1 is a conjugate view.*tensor it conjugates")


def test_complex_tensors_are_averaged_as_complex_numbers():
    stacked = torch.randn(4, 3, dtype=torch.complex64)
    out = puredist.average(stacked, collective=SimulatedCollective(4))
    torch.testing.assert_close(out, stacked.mean(0, keepdim=True).expand(4, 3))


def _complex_on_ranks(rank, world_size):
    z = torch.complex(torch.full((3,), float(rank)), torch.full((3,), 2.0 * rank))
    puredist.average_({"z": z}, collective=DistributedCollective())
    return z


def test_complex_tensors_are_averaged_on_real_ranks():
    for z in run_workers(_complex_on_ranks, 4):
        assert torch.equal(z, torch.complex(torch.full((3,), 1.5), torch.full((3,), 3.0)))


def _interleaved_on_ranks(rank, world_size):
    base = torch.arange(12.0) * (rank + 1)
    puredist.average_([base[::2], base[1::2]], collective=DistributedCollective(bucket_cap_bytes=32))
    return base


def test_interleaved_views_are_averaged_on_real_ranks():
    for base in run_workers(_interleaved_on_ranks, 2):
        assert torch.equal(base, torch.arange(12.0) * 1.5)


def test_a_tensor_changed_in_place_at_the_same_address_is_checked_again():
    # each change keeps the list's addresses (the layout cache's key) and changes the rest of the metadata
    values = torch.randn(2, 6)
    tensors = [torch.randn(2, 4), values]
    puredist.average_(tensors, collective=SimulatedCollective(2))  # checked and cached as valid
    values.as_strided_((2, 6), (6, 0))  # same shape, same address: now every row is one element repeated
    _refused(tensors, r"leaf 1 .*overlapping elements.*strides \(6, 0\)")
    ints = torch.zeros(2, 6)
    puredist.average_([ints], collective=SimulatedCollective(2))
    _refused([ints.view(torch.int32)], r"leaf 0 .*int32", TypeError)  # same address, shape and strides
    with torch.inference_mode():
        frozen = torch.randn(2, 4)
        puredist.average_([frozen], collective=SimulatedCollective(2))  # valid inside the mode
    _refused([frozen], r"leaf 0 .*inference tensor")


def test_an_inference_tensor_over_memory_checked_in_inference_mode_is_refused_outside_it():
    # inside inference mode a normal tensor and an inference tensor over the same memory look alike
    memory = np.zeros((2, 8), dtype=np.float32)
    normal = torch.from_numpy(memory)
    with torch.inference_mode():
        puredist.average_([normal], collective=SimulatedCollective(2))  # checked and cached inside the mode
        frozen = torch.from_numpy(memory)  # an inference tensor at the same address, of the same metadata
    _refused([frozen], r"leaf 0 .*inference tensor")


def test_a_negated_view_is_refused_before_anything_is_averaged():
    # z.conj().imag is a real tensor with the negative bit: torch's multi-tensor copy cannot write it
    z = torch.randn(2, 3, dtype=torch.complex64)
    _refused([torch.randn(2, 4), z.conj().imag], r"leaf 1 .*negated view.*tensor it views")


def test_a_nested_tensor_is_refused_by_name():
    with pytest.warns(UserWarning, match="nested"):
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    plain = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"Arg ``tensors``: tensor 1 is a nested tensor"):
        SimulatedCollective(2).mean_([plain, nested])


def _a_nested_view_at_a_checked_address(rank, world_size):
    buffer = torch.zeros(2, 5)
    puredist.average_([buffer], collective=SimulatedCollective(2))  # this address's layout is now known
    nested = torch._nested_view_from_buffer(buffer.view(-1), torch.tensor([[4], [6]]), torch.tensor([[1], [1]]),
                                            torch.tensor([0, 4]))
    assert nested.data_ptr() == buffer.data_ptr()
    with pytest.raises(ValueError, match="tensor 0 is a nested tensor"):
        SimulatedCollective(2).mean_([nested])
    return True


def test_a_nested_tensor_at_the_address_of_a_checked_tensor_is_refused():
    # the layout cache's guard read the nested tensor's strides, which aborted the process
    assert run_workers(_a_nested_view_at_a_checked_address, 1) == [True]


def _one_rank_passes_a_nested_tensor(rank, world_size):
    import time
    import warnings

    warnings.filterwarnings("ignore", message=".*nested")
    tensor = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]) if rank == 1 else torch.zeros(5)
    started = time.perf_counter()
    expected = ValueError if rank == 1 else puredist.RankMismatchError
    with pytest.raises(expected, match="nested tensor"):
        DistributedCollective().mean_([tensor])
    if rank == 1:
        time.sleep(8)  # alive: its peer must not wait for it
    return time.perf_counter() - started


def test_a_nested_tensor_on_one_rank_makes_its_peers_raise_at_once():
    # the layout cache read its shape first ("Internal error"): no refusal reached the peer, which waited
    seconds = run_workers(_one_rank_passes_a_nested_tensor, 2, gloo_timeout=20, timeout=40)
    assert seconds[0] < 5, seconds


def test_column_slices_of_a_large_matrix_are_averaged_and_overlapping_ones_refused():
    # their common byte range spans 16M elements: beyond the element-by-element comparison
    base = torch.randn(2, 2048, 4096)
    left, right = base[:, :, :2048], base[:, :, 2048:]
    expected = [v.mean(0, keepdim=True).expand_as(v).clone() for v in (left, right)]
    puredist.average_([left, right], collective=SimulatedCollective(2))
    assert torch.equal(left, expected[0]) and torch.equal(right, expected[1])
    _refused([base[:, :, :2049], base[:, :, 2048:]], r"leafs 0 and 1 share memory")
    _refused([base[:, :, 1::2], base[:, :, 3::2]], r"leafs 0 and 1 share memory")  # shifted by one column pair
    odd, even = base[:, :, 1::2], base[:, :, ::2]
    puredist.average_([odd, even], collective=SimulatedCollective(2))
