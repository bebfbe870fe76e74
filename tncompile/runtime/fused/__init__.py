"""Fused runtime blocks the passes put into graphs: attention (with its native kernel),
dropout, a feed-forward pair of TT linears, sibling TT linears reading one input."""
