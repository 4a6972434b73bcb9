"""Source ops (input, scalar, constant) and getitem, which selects one output of a multi-output op."""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..ir.registry import NO_UPCAST, SOURCE, Cost, define


def _no_infer(specs, attrs):  # type: ignore[no-untyped-def]
    raise ShapeError("source ops are created with their spec, not inferred")


define("input", _no_infer, lambda xs, a: xs[0], num_inputs=(0, 0), props={SOURCE},
       cost_fn=lambda i, o, a: Cost(0, 0), doc="A graph input (fed at execute time).")

define("scalar", _no_infer,
       lambda xs, a, spec=None: torch.tensor(a["value"]),
       num_inputs=(0, 0), props={SOURCE, NO_UPCAST}, cost_fn=lambda i, o, a: Cost(0, 0),
       triton=lambda args, a: repr(float(a["value"])) if not isinstance(a["value"], bool) else
       ("1" if a["value"] else "0"),
       doc="A Python number, typed like the tensor it meets (0-d).")

define("constant", _no_infer, lambda xs, a: a["value"], num_inputs=(0, 0), props={SOURCE, NO_UPCAST},
       cost_fn=lambda i, o, a: Cost(0, 0), doc="A tensor known at build time (from constant folding).")


def _getitem_infer(specs, attrs):  # type: ignore[no-untyped-def]
    raise ShapeError("getitem nodes are created by the emitter")


define("getitem", _getitem_infer, lambda xs, a: xs[0][a["index"]], props={NO_UPCAST},
       cost_fn=lambda i, o, a: Cost(0, 0), doc="Output `index` of a multi-output op.")
