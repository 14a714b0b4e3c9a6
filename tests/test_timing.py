"""ops.timing's CUPTI kernel time: device records split into calls at the marker kernel (on the CPU), and
the kernel time of torch and MAX kernels (on the GPU)."""

import pytest
import torch

from ops.layernorm import layernorm_fwd
from ops.timing import MARK_KERNEL, busy_us_per_call, measure

MARK = f"{MARK_KERNEL}(long)"


def test_calls_are_split_at_markers_and_overlaps_count_once() -> None:
    spans = [
        ("warm-up kernel", 0, 5_000),  # before the first marker: no timed call owns it
        (MARK, 10_000, 11_000),
        ("ln", 12_000, 14_500),
        (MARK, 20_000, 21_000),
        ("gemm", 22_000, 30_000),
        ("memset", 29_000, 31_000),  # overlaps the gemm: 1 us of it is new
        ("bias", 40_000, 40_500),
    ]
    assert busy_us_per_call(spans) == [2.5, 9.0 + 0.5]


def test_records_are_sorted_by_start_time_first() -> None:
    spans = [("b", 5_000, 6_000), (MARK, 0, 100), ("a", 1_000, 3_000), (MARK, 4_000, 4_100)]
    assert busy_us_per_call(spans) == [2.0, 1.0]


def test_a_call_with_no_recorded_work_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no device work"):
        busy_us_per_call([(MARK, 0, 100), ("a", 200, 300), (MARK, 400, 500)])


@pytest.mark.gpu
def test_kernel_time_on_the_gpu_counts_torch_and_max_kernels() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.empty_like(x)
    copy = measure(lambda a, b: b.copy_(a), [(x, y)], iters=10, kernels=True)
    assert 0 < copy.kernel_us <= 1.05 * copy.device_us
    twice = measure(lambda a, b: (b.copy_(a), b.copy_(a)), [(x, y)], iters=10, kernels=True)
    assert 1.8 * copy.kernel_us < twice.kernel_us < 2.2 * copy.kernel_us
    w, b = torch.ones(4096, device="cuda"), torch.zeros(4096, device="cuda")
    ln = measure(lambda *a: layernorm_fwd(*a)[0], [(x, w, b)], iters=10, kernels=True)  # runs on MAX's queue
    assert 0.5 * ln.device_us < ln.kernel_us <= 1.05 * ln.device_us
