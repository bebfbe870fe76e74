"""tncompile's functions that passes put into traced graphs, and the tracer that
keeps them whole when ``torch.fx`` pickles a graph module.

fx pickles a ``GraphModule`` as its generated Python source and, on load,
traces that source again with the graph's tracer class. A plain ``fx.Tracer``
would step into :func:`tt_siblings` and the others with proxies (and fail on
their device checks); :class:`GraphTracer` records each as one call, as the
graph had it. The serialization tables name the same functions (one list,
:data:`GRAPH_FUNCTIONS`).
"""
from __future__ import annotations

from torch import fx

from ..ways.attention import scaled_dot_product_attention
from .dropout import dropout
from .feed_forward import tt_feed_forward
from .siblings import tt_siblings

__all__ = ["GRAPH_FUNCTIONS", "GraphTracer", "keep_functions_when_pickled"]

GRAPH_FUNCTIONS = (dropout, tt_feed_forward, tt_siblings, scaled_dot_product_attention)


class GraphTracer(fx.Tracer):
    """``fx.Tracer`` with :data:`GRAPH_FUNCTIONS` as leaf functions."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("autowrap_functions", GRAPH_FUNCTIONS)
        super().__init__(*args, **kwargs)


def keep_functions_when_pickled(gm: fx.GraphModule) -> None:
    """Make ``pickle`` of ``gm`` re-trace with :class:`GraphTracer`."""
    gm._tracer_cls = GraphTracer
