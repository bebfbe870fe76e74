"""How each operation runs: one module per op, each with an enum of its ways, the one
function that chooses among them (the only code that reads export, compile, grad and
capture state and the tuned switches) and the runners.

* :mod:`.linear` -- a TT linear's call (exported, inference factors, Triton pair, native
  chain, whole matrix, thin pair, planned contraction); the row ways measured
  (:mod:`.measured`).
* :mod:`.lookup` -- a TTM embedding's lookup.
* :mod:`.tied_head` -- an output head tied to a TTM embedding.
* :mod:`.merge` -- how TT linears merge their factors (alone, batched, Triton).
* :mod:`.experts` -- a layer of TT experts (grouped product or per expert).
* :mod:`.feed_forward`, :mod:`.siblings` -- a TT feed-forward block (fused or layer by
  layer) and TT linears sharing an input (one pass over it or each layer).
* :mod:`.attention`, :mod:`.dropout` -- attention and dropout (native kernel, one
  traceable op under ``torch.compile``, or PyTorch's).
* :mod:`.network` -- how a layer reads its gated cores and plans in the current context.
* :mod:`.rows` -- what every row way shares (padding, checks, the product through factors).

Layers (:mod:`..layers`) and fused blocks (:mod:`..fused`) hold parameters and call
``ways.<op>.run(...)`` once; no module there reads the context (``tests/test_architecture.py``).
"""
