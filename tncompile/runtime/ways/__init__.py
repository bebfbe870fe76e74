"""How each operation runs: one module per op, each with an enum of its ways, the one
function that chooses among them (the only code that reads export, compile, grad and
capture state and the tuned switches) and the runners.

* :mod:`.linear` -- a TT linear's call (exported, inference factors, Triton pair, native
  chain, whole matrix, thin pair, planned contraction); the row ways measured
  (:mod:`.measured`).
* :mod:`.lookup` -- a TTM embedding's lookup.
* :mod:`.tied_head` -- an output head tied to a TTM embedding.
* :mod:`.merge` -- how TT linears merge their factors (alone, batched, Triton).
* :mod:`.network` -- how a layer reads its gated cores and plans in the current context.
* :mod:`.rows` -- what every row way shares (padding, checks, the product through factors).

Layers (:mod:`..layers`) hold parameters and call ``ways.<op>.run(layer, x)`` once.
"""
