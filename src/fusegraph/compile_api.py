"""fg.compile and fg.explain: fusegraph as a torch.compile backend, with our modes, options and report.

    model = fg.compile(model, mode="max-performance")
    print(fg.explain(model, x))        # what was compiled, what runs eagerly in torch and why
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .frontends.torch_backend import CompileReport


def compile(model: Any, mode: str = "default", options: dict[str, Any] | None = None, *,
            dynamic: bool | None = False, fullgraph: bool = False) -> Any:
    """torch.compile(model) with fusegraph as the backend. Static shapes by default (dynamic=False):
    a new input shape recompiles, up to settings.max_recompiles per frame. With dynamic=None (torch's
    default) a graph that dynamo traces with symbolic dims is compiled once per concrete shape at
    its first call. The compiled object's `fusegraph_report` describes every graph compiled so far."""
    from .frontends.torch_backend import Session

    session = Session(mode, options)
    compiled = torch.compile(model, backend=session, dynamic=dynamic, fullgraph=fullgraph)
    with contextlib.suppress(AttributeError):  # a wrapper that takes no attributes: the report stays in the Session
        compiled.fusegraph_report = session.report  # type: ignore[attr-defined]
    return compiled


def explain(model: Any, *inputs: Any, mode: str = "default", options: dict[str, Any] | None = None,
            **kwargs: Any) -> CompileReport:
    """Compile `model` with fusegraph, run it once on `inputs`, and return the report: per ATen graph,
    the partitions compiled (ops, kernel count) and the ops that run eagerly in torch, with why.
    A model compiled by fg.compile is explained from its original module/function. With parameters
    that require grad this is the training forward graph (the backward compiles at .backward());
    call it under torch.no_grad() for the inference graph."""
    from .frontends.torch_backend import Session

    original = getattr(model, "_orig_mod", model)
    session = Session(mode, options)
    compiled = torch.compile(original, backend=session, dynamic=False)
    compiled(*inputs, **kwargs)
    return session.report
