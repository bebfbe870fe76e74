"""A user's own rewrite pass: tensorize only every other encoder block.

Run: python examples/custom_pass.py

The pass runs after ``tensorize`` and before ``assign_ranks``: it walks the fx
graph, finds the pending TT layers of odd-numbered blocks and puts the dense
layer back. ``assign_ranks`` then spends the whole budget on the remaining
layers, and the dump after the pass shows the change.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

import tncompile
from tncompile.passes import PendingLayer
from tncompile.testing import small_encoder


class EveryOtherBlock(tncompile.Pass):
    """Keep the layers of odd-numbered blocks (``layers.1``, ``layers.3``...) dense."""

    name = "every-other-block"

    def run(self, program):
        gm = program.graph_module
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            module = gm.get_submodule(node.target)
            block = re.match(r"layers\.(\d+)\.", node.target)
            if isinstance(module, PendingLayer) and block and int(block.group(1)) % 2 == 1:
                gm.set_submodule(node.target, module.dense)  # back to the dense layer
                program.notes[node.target] = "kept dense by every-other-block"
        return program


def main() -> None:
    model = small_encoder(n_layers=4)
    pipeline = tncompile.default_pipeline().insert_after("tensorize", EveryOtherBlock())
    print("pipeline:", pipeline)
    with tempfile.TemporaryDirectory() as dump:
        compiled = tncompile.compile(model, target_ratio=0.5, passes=pipeline, dump_dir=dump)
        after = (Path(dump) / "02-every-other-block.txt").read_text()
        print("dump after the custom pass (block 1):")
        print("\n".join(l for l in after.splitlines() if "layers.1.ff1" in l and "#" in l))
    print(compiled.report())
    ids = torch.randint(1, 1000, (2, 16))
    print("output:", tuple(compiled(ids).shape))


if __name__ == "__main__":
    main()
