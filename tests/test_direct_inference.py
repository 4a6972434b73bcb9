"""frontends/torch_backend.direct_inference (setting direct_inference, on by default): an inference
graph's compiled function handed to Dynamo without AOTAutograd's runtime wrapper, only where that
wrapper would do nothing but switch grad mode and autocast around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.settings import override


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Cache(nn.Module):
    """A decode-style step: writes its input into a buffer at a position (kept in the graph), then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0) * 2


class Aliasing(nn.Module):
    """Returns a view of its input beside a computed value: AOTAutograd rebuilds the view at run time."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(-1), torch.relu(x) + 1


def compiled(model: nn.Module, *args: torch.Tensor, on: bool = True) -> tuple[object, object]:
    """Two calls of fg.compile(model) under no_grad, with settings.direct_inference = on: (the second
    call's output, the inference graph's record)."""
    torch._dynamo.reset()
    with override(direct_inference=on):
        run = fg.compile(model)
        with torch.no_grad():
            out = run(*args)
            out = run(*args)      # a second call through the same function
    (graph,) = run.fusegraph_report.graphs
    return out, graph


@pytest.mark.parametrize("on", [True, False])
def test_a_plain_inference_graph_skips_the_wrapper_when_on(on: bool) -> None:
    model = Mlp()
    x = rand(2, 8)
    out, graph = compiled(model, x, on=on)
    assert graph.kind == "inference" and graph.direct is on
    with torch.no_grad():
        assert_close(out, model(x), tol=1e-5, what="output")


def test_input_mutations_kept_in_the_graph_still_qualify_and_land() -> None:
    model, twin = Cache(), Cache()
    x, pos = rand(1, 8), torch.tensor([2])
    out, graph = compiled(model, x, pos)
    assert graph.direct
    with torch.no_grad():
        ref = twin(x, pos)
        ref = twin(x, pos)
    assert_close(out, ref, tol=1e-5, what="output")
    assert torch.equal(model.cache, twin.cache)    # the write reached the module's buffer


def test_an_output_aliasing_an_input_keeps_the_wrapper_and_its_view() -> None:
    x = rand(2, 4)
    (view, value), graph = compiled(Aliasing(), x)
    assert not graph.direct
    assert view.data_ptr() == x.data_ptr()          # a view of x, as in eager, not a copy
    assert_close(value, torch.relu(x) + 1, tol=1e-6, what="output")


def test_autocast_inference_runs_direct_with_eager_dtypes() -> None:
    model = Mlp()
    x = rand(2, 8)
    torch._dynamo.reset()
    run = fg.compile(model)
    with override(direct_inference=True), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(x)
        ref = model(x)
    (graph,) = run.fusegraph_report.graphs
    assert graph.direct
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), tol=2e-2, what="output")
