"""Helper for test_training: one leg of a rank-adaptive run, in its own process.

``python resume_run.py full CKPT OUT``   trains 11 steps, checkpointing (only) at step 6.
``python resume_run.py resume CKPT OUT`` loads CKPT in this fresh process and
trains the remaining steps. Both write ``{"losses": [...], "events": [...]}``
with losses as float.hex strings (bit-exact comparison). ``RESUME_RUN_WAYS=deterministic``
runs both legs under ``torch.use_deterministic_algorithms(True)``, ``=prior`` with
``tuning.MEASURE_WAYS = False``: ways chosen by a fixed rule, never by timing.
"""
import json
import os
import sys

import torch

import tncompile
from tncompile.testing import small_encoder

EARLY, LATE, SAVE_AT = 5, 6, 6


def batches():
    g = torch.Generator().manual_seed(123)
    return [(torch.randint(1, 1000, (8, 16), generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(4)]


def make_optimizer(compiled):
    return torch.optim.AdamW(tncompile.param_groups(compiled, lr=2e-3, gate_lr=5e-2))


def make_controller(compiled, opt):
    # a high threshold so that ranks are cut within a few steps: at steps 4 and 8
    return tncompile.RankController(compiled, opt, target_ratio=0.05, threshold=0.95, rank_weight=1.0,
                                    truncate_every=4)


def main(mode, ckpt, out):
    torch.set_num_threads(1)
    ways = os.environ.get("RESUME_RUN_WAYS", "")
    if ways == "deterministic":
        torch.use_deterministic_algorithms(True)
    elif ways == "prior":
        tncompile.tuning.MEASURE_WAYS = False
    if mode == "full":
        torch.manual_seed(0)
        compiled = tncompile.compile(small_encoder(), target_ratio=0.2, init="random")
        opt = make_optimizer(compiled)
        ctl = make_controller(compiled, opt)
        history = tncompile.fit(compiled, batches(), torch.nn.functional.cross_entropy, opt, ctl,
                                early_steps=EARLY, late_steps=LATE, checkpoint_path=ckpt,
                                checkpoint_every=SAVE_AT, progress=False)
        ran = len(history)
    else:
        compiled = tncompile.load(ckpt, model=small_encoder())
        opt = make_optimizer(compiled)
        ctl = make_controller(compiled, opt)
        extra = tncompile.resume(compiled, opt, ctl)
        done = len(extra["history"]["step"])
        history = tncompile.fit(compiled, batches(), torch.nn.functional.cross_entropy, opt, ctl,
                                early_steps=EARLY, late_steps=LATE, history=extra["history"],
                                progress=False)
        ran = len(history) - done
    with open(out, "w") as f:
        json.dump({"ran": ran, "losses": [float(x).hex() for x in history.loss], "steps": history.step,
                   "events": history.events, "ranks": {k: list(v) for k, v in ctl.ranks().items()}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
