"""The bucket plan: every element in exactly one piece, buckets bounded, one device
and dtype each, pieces of a tensor in order (so progress is a leading range)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from puredist.staging.plan import plan_buckets

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@st.composite
def tensor_lists(draw):
    specs = draw(st.lists(st.tuples(st.integers(0, 64), st.sampled_from(DTYPES), st.booleans()), max_size=12))
    tensors = []
    for numel, dtype, contiguous in specs:
        t = torch.zeros(2 * numel, dtype=dtype)
        tensors.append(t if contiguous else t[::2])
    return tensors


@given(tensors=tensor_lists(), bucket_bytes=st.integers(1, 300))
def test_plan_covers_every_element_once_in_bounded_buckets_of_one_dtype(tensors, bucket_bytes):
    buckets = plan_buckets(tensors, bucket_bytes)
    covered = {i: [] for i in range(len(tensors))}
    for bucket in buckets:
        members = [tensors[p.index] for p in bucket.pieces]
        assert len({(t.device, t.dtype) for t in members}) == 1  # no promotion
        size = members[0].element_size()
        assert bucket.nbytes == sum((p.stop - p.start) * size for p in bucket.pieces)
        # bounded, except one element or one whole non-contiguous tensor alone
        alone = len(bucket.pieces) == 1 and (bucket.pieces[0].stop - bucket.pieces[0].start == 1 or not members[0].is_contiguous())
        assert bucket.nbytes <= bucket_bytes or alone
        for piece in bucket.pieces:
            covered[piece.index].append((piece.start, piece.stop))
    for index, ranges in covered.items():
        tensor = tensors[index]
        # pieces of one tensor tile [0, numel) in issue order: progress is a leading range
        expected_start = 0
        for start, stop in ranges:
            assert start == expected_start and stop > start or tensor.numel() == 0
            expected_start = stop
        assert expected_start == tensor.numel()
        if not tensor.is_contiguous():
            assert len(ranges) <= 1  # never cut


def test_a_large_tensor_is_cut_and_small_ones_fill_the_buckets():
    big, small_a, small_b = torch.zeros(250), torch.zeros(10), torch.zeros(10)
    buckets = plan_buckets([small_a, big, small_b], bucket_bytes=400)  # 100 floats a bucket
    assert [[tuple(p) for p in b.pieces] for b in buckets] == [
        [(0, 0, 10), (1, 0, 90)],
        [(1, 90, 190)],
        [(1, 190, 250), (2, 0, 10)],
    ]


def test_dtypes_get_buckets_of_their_own_in_order_of_appearance():
    f32, bf16, f32b = torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)
    buckets = plan_buckets([f32, bf16, f32b], bucket_bytes=1000)
    assert [[p.index for p in b.pieces] for b in buckets] == [[0, 2], [1]]


@given(tensors=tensor_lists(), bucket_bytes=st.integers(1, 300), alone_from=st.integers(1, 200))
def test_large_contiguous_tensors_never_share_a_bucket_when_asked(tensors, bucket_bytes, alone_from):
    buckets = plan_buckets(tensors, bucket_bytes, alone_from=alone_from)
    for index, tensor in enumerate(tensors):  # pieces still tile each tensor, in order
        ranges = [(p.start, p.stop) for b in buckets for p in b.pieces if p.index == index]
        assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] or not ranges
        assert (ranges[-1][1] if ranges else 0) == tensor.numel()
    for bucket in buckets:
        large = [p.index for p in bucket.pieces
                 if tensors[p.index].is_contiguous() and tensors[p.index].numel() * tensors[p.index].element_size() >= alone_from]
        if large:
            assert {p.index for p in bucket.pieces} == {large[0]}


def test_the_default_staging_cap_is_larger_for_the_tensors_that_go_over_nccl():
    """Without a cap, the tensors a group reduces over NCCL are staged in buckets of
    half of 256 MiB, all others (host tensors, a GPU's over Gloo) in buckets of half of
    32 MiB (the meta device stands for a GPU here: it has no data). Brute force: the
    bucket sizes a run launches, per device."""
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    class Done:
        def wait(self):
            return True

    mib = 2**20
    backends = {"cpu": "gloo", "meta": "nccl"}  # as "cpu:gloo,cuda:nccl"
    launched = {}
    for device, pool in (("cpu", StagingPool(backends=backends)), ("meta", StagingPool(backends=backends)),
                         ("meta over gloo", StagingPool(backends={"meta": "gloo"}))):
        tensors = [torch.zeros(10 * mib, device=device[:4]), torch.zeros(5 * mib, device=device[:4])]  # 60 MiB of fp32
        sizes = launched[device] = []
        run_staged(tensors, lambda buffer: sizes.append(buffer.numel() * 4) or Done(), StagingOptions("test"),
                   pool=pool, async_op=False)
    assert launched["cpu"] == launched["meta over gloo"] == [16 * mib] * 3 + [12 * mib]
    assert launched["meta"] == [60 * mib]
    assert StagingPool(backends=backends).capacity(torch.device("cpu")) == 32 * mib
    assert StagingPool(backends=backends).capacity(torch.device("meta")) == 256 * mib
    assert StagingPool(4096, backends=backends).capacity(torch.device("meta")) == 4096


def test_spare_staging_buffers_are_kept_within_each_devices_own_cap():
    """An asynchronous run's buffers are kept for the next one up to the cap of their
    own device: the host's 32 MiB are not used up by a GPU's (meta stands for one)."""
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    class Done:
        def wait(self):
            return True

    mib = 2**20
    pool = StagingPool(backends={"cpu": "gloo", "meta": "nccl"})
    tensors = [torch.zeros(100 * mib // 4, device="meta"), torch.zeros(mib // 4)]  # 100 MiB on "GPU", then 1 on the host
    seen = []
    for _ in range(2):
        run_staged(tensors, lambda buffer: seen.append(buffer.data_ptr()) or Done(), StagingOptions("test"),
                   pool=pool, async_op=True).wait()
    host = [ptr for ptr in seen if ptr != 0]  # (meta tensors have no data)
    assert len(host) == 2 and host[0] == host[1]  # the host's spare was kept and reused
    assert pool._spare_bytes == {torch.device("cpu"): mib, torch.device("meta"): 100 * mib}


def test_staging_and_the_errors_import_what_their_contracts_allow_and_form_no_cycle():
    """The contracts, checked on the imports themselves (``TYPE_CHECKING`` ones
    included): ``puredist.errors`` imports nothing of puredist (every module may raise
    its errors) nor torchft (optional); the plan reads metadata only (nothing of
    puredist); staging talks to other ranks only through the ``launch`` and ``gate`` it
    is given (no ``torch.distributed``) and checks nothing (no validation module); its
    modules import none that imports them back."""
    import pathlib

    import puredist.errors
    import puredist.staging
    from import_rules import cycles, imports_of, package_imports

    errors = imports_of(pathlib.Path(puredist.errors.__file__))
    assert not {m for m in errors if m.split(".")[0] in ("puredist", "torchft")}, sorted(errors)
    graph = package_imports(pathlib.Path(puredist.staging.__file__).parent, "puredist.staging")
    assert set(graph) == {"puredist.staging", "puredist.staging.plan", "puredist.staging.pool", "puredist.staging.run"}
    allowed = {"puredist._layout", "puredist.errors"}
    for name, imported in graph.items():
        ours = {m for m in imported if m.split(".")[0] == "puredist" and not m.startswith("puredist.staging")}
        assert ours <= allowed, f"{name} imports {sorted(ours - allowed)}"
        assert not any(m.startswith("torch.distributed") for m in imported), name
    assert not {m for m in graph["puredist.staging.plan"] if m.split(".")[0] == "puredist"}
    within = {name: {m for m in imported if m.startswith("puredist.staging.")} for name, imported in graph.items()}
    assert not cycles(within), f"import cycles through {cycles(within)}"


def test_a_blocking_run_never_packs_a_bucket_over_one_still_in_flight():
    """The pool's ring under uneven buckets (an fp32 tensor, then fp16 ones; a 4 KiB
    cap: buckets of at most 2 KiB): a bucket that wraps to the ring's start must wait
    for every bucket its span overlaps, not only the one its start falls in. The
    collective here reads its buffer only when waited on (a backend may read it any
    time until then) and doubles it; the oracle: every element doubled."""
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    class Doubles:
        def __init__(self, buffer):
            self.buffer = buffer

        def wait(self):
            self.buffer.mul_(2)
            return True

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(250, generator=gen)]  # 1000 bytes: ring [0, 1024)
    tensors += [torch.randn(1024, generator=gen).half() for _ in range(3)]  # 2 KiB each: [1024, 3072), then at 0
    expected = [2 * t for t in tensors]
    launched = []
    run_staged(tensors, lambda buffer: launched.append(buffer.data_ptr()) or Doubles(buffer),
               StagingOptions("test", bucket_cap_bytes=4096), pool=StagingPool(4096), async_op=False)
    assert len(launched) == 4  # (the layout the test means: a bucket a tensor)
    for i, (tensor, want) in enumerate(zip(tensors, expected)):
        assert torch.equal(tensor, want), f"tensor {i}: {(tensor != want).sum()} elements not doubled"
