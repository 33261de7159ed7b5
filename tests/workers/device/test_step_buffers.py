"""The persistent step buffer: pieces laid out in order from its start, the device views at
fixed addresses step after step, and a step too large for it refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.device.step_buffers import StepBuffers


def test_pieces_are_consecutive_views_at_fixed_addresses() -> None:
    buffers = StepBuffers(32, torch.device("cpu"))
    a, b = buffers.host_views([(3,), (2, 4)])
    a[:] = [1, 2, 3]
    b[:] = np.arange(8).reshape(2, 4)
    da, db = buffers.upload()
    assert da.tolist() == [1, 2, 3] and db.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert db.data_ptr() == da.data_ptr() + 3 * 8
    # The next step reuses the buffer: same addresses, new contents; nothing is allocated.
    (c,) = buffers.host_views([(3,)])
    c[:] = [7, 8, 9]
    (dc,) = buffers.upload()
    assert dc.data_ptr() == da.data_ptr() and dc.tolist() == [7, 8, 9]
    assert [v.data_ptr() for v in buffers.device_views([(3,), (2, 4)])] == [
        da.data_ptr(),
        db.data_ptr(),
    ]
    assert buffers.uploads == 2


def test_a_step_larger_than_the_buffer_is_refused() -> None:
    buffers = StepBuffers(8, torch.device("cpu"))
    with pytest.raises(ValueError, match="9 integers of metadata, more than the 8"):
        buffers.host_views([(4,), (5,)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_host_buffer_is_pinned_and_one_copy_moves_the_step() -> None:
    buffers = StepBuffers(64, torch.device("cuda"))
    assert buffers.host.is_pinned() and buffers.dev.is_cuda
    (a,) = buffers.host_views([(5,)])
    a[:] = range(5)
    (da,) = buffers.upload()
    assert da.is_cuda and da.tolist() == [0, 1, 2, 3, 4]
