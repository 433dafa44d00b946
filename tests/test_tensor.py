"""stepwatch.Tensor: what MindSpore code does with cb_params.net_outputs works."""

from __future__ import annotations

import numpy as np
import torch

import stepwatch
from stepwatch._tensor import as_stepwatch_tensor


def test_tensor_behaves_like_a_number_and_a_mindspore_tensor() -> None:
    raw = torch.tensor(0.25, requires_grad=True) * 2
    t = as_stepwatch_tensor(raw)
    assert isinstance(t, stepwatch.Tensor) and isinstance(t, torch.Tensor)
    assert not t.requires_grad
    assert t.asnumpy() == np.float32(0.5) and isinstance(t.asnumpy(), np.ndarray)
    assert float(t) == 0.5 and bool(t > 0.4) and bool(t < 1)
    assert f"{t}" == "0.5" and f"{t:.3f}" == "0.500"
    assert type(t * 2) is torch.Tensor  # arithmetic returns plain tensors
    assert as_stepwatch_tensor(t) is t and as_stepwatch_tensor(3) == 3


def test_multi_element_tensor_formats_like_torch() -> None:
    t = as_stepwatch_tensor(torch.tensor([1.0, 2.0]))
    np.testing.assert_array_equal(t.asnumpy(), [1.0, 2.0])
    assert "1." in f"{t}"
