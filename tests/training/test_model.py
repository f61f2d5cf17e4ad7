"""The CNN: shapes, dtypes, parameter budget, refusal of unsupported inputs."""

from __future__ import annotations

import pytest
import torch

from lmdbstore.training.model import build_cnn


def test_shapes_and_budget() -> None:
    m = build_cnn((25, 25), 5, width=16)
    assert sum(p.numel() for p in m.parameters()) < 50_000
    out = m(torch.randn(7, 1, 25, 25))
    assert out.shape == (7, 5)
    assert build_cnn((3, 32, 32), 10)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_integer_inputs_are_cast() -> None:
    m = build_cnn((25, 25), 3).eval()
    x = torch.randint(0, 255, (4, 1, 25, 25), dtype=torch.uint8)
    assert torch.allclose(m(x), m(x.float()))


def test_a_few_steps_reduce_the_loss() -> None:
    torch.manual_seed(0)
    m = build_cnn((12, 12), 2)
    x = torch.randn(256, 1, 12, 12)
    y = (x[:, 0, :6].mean((1, 2)) > x[:, 0, 6:].mean((1, 2))).long()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("shape", [(100,), (2, 2), (1, 2, 3, 4)])
def test_unsupported_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        build_cnn(shape, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_inputs_are_cast(dtype: torch.dtype) -> None:
    m = build_cnn((3, 8, 8), 3).eval()
    x = torch.randn(4, 3, 8, 8).to(dtype)
    assert m(x).dtype == torch.float32
    assert torch.allclose(m(x), m(x.float()))
