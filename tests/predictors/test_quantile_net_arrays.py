"""`QuantileNetArrays`, neural-length's serving forward pass: the same outputs as the torch
`QuantileNet` it was trained as, quantiles that never cross, and weights of another shape
refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from predictors.quantile_mlp import QuantileNet
from predictors.quantile_net_arrays import QuantileNetArrays


def _pair(seed: int, inputs: int = 10, hidden: int = 16, quantiles: int = 3):
    torch.manual_seed(seed)
    net = QuantileNet(inputs, hidden, quantiles).eval()
    weights = {name: tensor.numpy().copy() for name, tensor in net.state_dict().items()}
    return net, QuantileNetArrays(weights, inputs, hidden, quantiles)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 300), scale=st.floats(0.1, 30.0))
def test_numpy_forward_equals_torch_eval_forward(seed, rows, scale):
    net, arrays = _pair(seed)
    x = (np.random.default_rng(seed).standard_normal((rows, 10)) * scale).astype(np.float32)
    with torch.inference_mode():
        expected = net(torch.from_numpy(x)).numpy()
    got = arrays(x)
    assert got.shape == (rows, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    assert (np.diff(got, axis=1) >= 0).all()


def test_gelu_and_softplus_by_hand():
    # one hidden unit per layer, identity-like weights: out_0 = gelu(gelu(x)), out_1 = out_0 + softplus(b)
    weights = {
        "body.0.weight": np.array([[1.0]]),
        "body.0.bias": np.array([0.0]),
        "body.3.weight": np.array([[1.0]]),
        "body.3.bias": np.array([0.0]),
        "body.5.weight": np.array([[1.0], [0.0]]),
        "body.5.bias": np.array([0.0, np.log(np.e - 1.0)]),  # softplus = log(1 + e - 1) = 1
    }
    arrays = QuantileNetArrays(weights, inputs=1, hidden=1, quantiles=2)
    # gelu(1) = 0.5 * (1 + erf(1 / sqrt 2)) = 0.841345;
    # gelu(0.841345) = 0.5 * 0.841345 * (1 + erf(0.594914)) = 0.673011
    out = arrays(np.array([[1.0]]))
    assert out[0].tolist() == pytest.approx([0.673011, 1.673011], abs=1e-5)


def test_weights_of_another_shape_are_refused_by_name():
    weights = {name: np.zeros(1) for name in ("body.0.weight", "body.0.bias", "body.3.weight")}
    weights |= {"body.3.bias": np.zeros(16), "body.5.weight": np.zeros((3, 16)), "body.5.bias": np.zeros(3)}
    with pytest.raises(ValueError) as refused:
        QuantileNetArrays(weights, 10, 16, 3)
    message = str(refused.value)
    assert "body.0.weight: expected (16, 10), got (1,)" in message
    assert "body.3.bias" not in message and "body.5" not in message  # only what does not fit
    with pytest.raises(ValueError, match=r"body\.5\.bias: expected \(3,\), got none"):
        QuantileNetArrays({k: v for k, v in weights.items() if k != "body.5.bias"}, 10, 16, 3)
