"""Rank-adaptive training under DistributedDataParallel and FSDP2: 2 processes,
gloo on 127.0.0.1, bounded in time. Replicas stay identical across cuts and the
stage switch, the run equals one process averaging the same micro-batches (with
dropout: each rank's stream swapped in), every process makes the same
late-stage choices, mismatched cuts raise everywhere, FSDP2 cuts by gather ->
cut -> reshard equal the DDP run, and a DDP step meets what CUDA-graph capture
needs (side stream, 11 warm-up steps, again after cuts)."""
from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tncompile
from tncompile.distributed import DistributedModel, RankMismatchError
from tncompile.testing import mlp, small_encoder

WORLD = 2
STEPS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(rank: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        out.append((x, (x[:, :10]).argmax(1)))
    return out


def _setup(schedule="budget"):
    torch.manual_seed(0)
    compiled = tncompile.compile(mlp((64, 256, 256, 10)), target_ratio=0.3)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.12, early_steps=8, late_steps=16,
                                   truncate_every=4, schedule=schedule, recovery=0.25)
    return compiled, opt, ctl


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_all(t: torch.Tensor) -> bool:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(sizes, torch.tensor([t.numel()]))
    if len({int(s) for s in sizes}) != 1:
        return False
    got = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(g, got[0]) for g in got)


# ---------------------------------------------------------------- workers (one per process)
def _worker(rank: int, port: int, scenario: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        result = SCENARIOS[scenario](rank, Path(out_dir))
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _ddp_step(model: DistributedModel, opt, ctl, x, y) -> bool:
    """One training step through the DDP wrapper; are the replicas identical after it?"""
    task = F.cross_entropy(model(x), y)
    (task + ctl.penalty(task)).backward()
    opt.step()
    opt.zero_grad()
    model.after_step(ctl.step())
    return _same_on_all(_flat(model.module))


def _train_ddp(rank: int, out: Path) -> dict:
    compiled, opt, ctl = _setup()
    model = DistributedModel(compiled)
    identical, ranks = [], []
    for x, y in _batches(rank):
        identical.append(_ddp_step(model, opt, ctl, x, y))
        ranks.append(ctl.ranks())
    return {"identical": identical, "rebuilds": model.rebuilds, "ratio": compiled.ratio,
            "ranks": {k: list(v) for k, v in ctl.ranks().items()}, "params": _flat(compiled).tolist(),
            "stage": ctl.stage}


def _comera_choices(rank: int, out: Path) -> dict:
    compiled, opt, ctl = _setup(schedule="comera")
    choices = []
    for x, y in _batches(rank):
        task = F.cross_entropy(compiled(x), y)  # no DDP here: replicas drift, the choice must not
        (task + ctl.penalty(task)).backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
        if ctl.last_choice is not None:
            choices.append(bool(ctl.last_choice))
    agreed = _same_on_all(torch.tensor(choices, dtype=torch.int64))
    return {"choices": choices, "agreed": agreed}


def _mismatch(rank: int, out: Path) -> dict:
    compiled, opt, ctl = _setup()
    ctl.start_late_stage(target_loss=1.0)
    try:
        ctl.truncate(budget=0.25 if rank == 0 else 0.15)  # different budgets: different cuts
    except RankMismatchError as e:
        return {"raised": str(e)}
    return {"raised": None}


def _fit_with_checkpoint(rank: int, out: Path) -> dict:
    compiled, opt, ctl = _setup()
    torch.manual_seed(1000 + rank)  # each rank's own random stream
    history = tncompile.fit(compiled, _batches(rank), F.cross_entropy, opt, ctl, early_steps=8, late_steps=16,
                            ddp={}, checkpoint_path=out / "ckpt.tnc", checkpoint_every=12, progress=False)
    same = _same_on_all(_flat(compiled))
    loaded = tncompile.load(out / "ckpt.tnc", model=mlp((64, 256, 256, 10)))
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    ctl2 = tncompile.RankController(loaded, opt2, target_ratio=0.12, early_steps=8, late_steps=16,
                                    truncate_every=4, recovery=0.25)
    extra = tncompile.resume(loaded, opt2, ctl2)
    mine = extra["rng_per_rank"][rank]
    return {"identical": same, "ratio": compiled.ratio, "steps": len(history.step),
            "own_rng_restored": bool(torch.equal(torch.get_rng_state(), mine)),
            "streams_differ": not torch.equal(extra["rng_per_rank"][0], extra["rng_per_rank"][1])}


def _every_runtime_path(rank: int, out: Path) -> dict:
    """The six-encoder (TTM lookups, fused feed-forward blocks over 256 rows, native
    dropout, planned executor) and an MLP over 4 rows (the native chain): replicas
    identical at every step through cuts and the stage switch."""
    from tncompile.testing import small_encoder
    torch.manual_seed(0)
    encoder = tncompile.compile(small_encoder(max_len=64), target_ratio=0.3, init="random")
    tiny = tncompile.compile(mlp((64, 256, 256, 10)), target_ratio=0.3)
    identical, kinds = [], set()
    for compiled, make_batch in ((encoder, lambda g: (torch.randint(1, 1000, (4, 64), generator=g),
                                                      torch.randint(0, 3, (4,), generator=g))),
                                 (tiny, lambda g: (torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,),
                                                                                                   generator=g)))):
        kinds |= {type(m).__name__ for m in compiled.modules()}
        opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
        ctl = tncompile.RankController(compiled, opt, target_ratio=0.6 * compiled.ratio, early_steps=4,
                                       late_steps=8, truncate_every=2)
        model = DistributedModel(compiled)
        g = torch.Generator().manual_seed(7 + rank)
        torch.manual_seed(50 + rank)  # dropout masks differ per process, as they would
        for _ in range(12):
            identical.append(_ddp_step(model, opt, ctl, *make_batch(g)))
        identical.append(compiled.ratio <= 0.6 * ctl.compiled.program.compiled_ratio + 1e-9)
    return {"identical": identical, "kinds": sorted(kinds)}


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)


def _encoder_batches(rank: int, steps: int = 12):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randint(0, 1000, (4, 16), generator=g), torch.randint(0, 2, (4,), generator=g))
            for _ in range(steps)]


def _cut_run(rank: int, model: str, wrap) -> dict:
    """Train with rank cuts through ``wrap(compiled)``; the full weights after every step."""
    from torch.distributed.tensor import DTensor

    from tncompile.testing import small_encoder
    if model == "mlp":
        compiled, opt, ctl = _setup()
        batches = _batches(rank)
    else:
        torch.manual_seed(0)
        compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3)
        batches = _encoder_batches(rank)
    wrapped = wrap(compiled)
    if model != "mlp":  # FSDP2: the optimizer is built over the shards, as usual
        opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
        ctl = tncompile.RankController(compiled, opt, target_ratio=0.15, early_steps=4, late_steps=8,
                                       truncate_every=2)
    elif not isinstance(wrapped, DistributedModel):  # the MLP's optimizer came first: move it onto the shards
        opt.param_groups.clear()
        opt.state.clear()
        for group in tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2):
            opt.add_param_group(group)
        ctl.optimizer = opt
    weights, cuts, sharded_after_cuts = [], 0, []
    for x, y in batches:
        task = F.cross_entropy(wrapped(x), y)
        (task + ctl.penalty(task)).backward()
        opt.step()
        opt.zero_grad()
        event = ctl.step()
        if isinstance(wrapped, DistributedModel):
            wrapped.after_step(event)
        elif event.shapes_changed:
            cuts += 1
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            sharded_after_cuts.append(all(isinstance(p, DTensor) and id(p) in held for p in compiled.parameters())
                                      and all(isinstance(v, DTensor) for st in opt.state.values()
                                              for k, v in st.items() if k != "step"))
        weights.append(torch.cat([_full(p) for p in compiled.parameters()]))
    return {"weights": weights, "ranks": ctl.ranks(), "cuts": cuts, "sharded": sharded_after_cuts,
            "compiled": compiled, "opt": opt, "ctl": ctl}


def _whole_matches_full_tensor() -> dict:
    """``whole`` (one packed all-gather) against DTensor's own ``full_tensor`` per tensor,
    values and gradients, on uneven shards (5 rows over 2 processes, 1 row, 4 rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tncompile.train.sharding import summed_over_shards, whole
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(3)
    fulls = [torch.randn(5, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64),
             torch.randn(4, 2, 2, dtype=torch.float64)]
    shards = [distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for t in fulls]

    def loss(tensors):
        return sum((t.pow(3) * torch.arange(t.numel(), dtype=t.dtype).view(t.shape)).sum() for t in tensors)
    got = whole(shards)
    want = [s.full_tensor() for s in shards]
    grads_got = torch.autograd.grad(loss(got), shards)
    grads_want = torch.autograd.grad(loss(want), shards)
    squares = torch.stack([s.to_local().pow(2).sum() for s in shards])
    total = summed_over_shards(squares, mesh.get_group())
    (g_total,) = torch.autograd.grad(total.sum() * 3, shards[:1])
    return {"values": all(torch.equal(a, b) for a, b in zip(got, want)),
            "full": all(torch.equal(a, b) for a, b in zip(got, fulls)),
            "grads": all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(grads_got, grads_want)),
            "sums": torch.allclose(total, torch.stack([t.pow(2).sum() for t in fulls])),
            "sum_grad": torch.allclose(g_total.to_local(), 6 * shards[0].to_local())}


def _bert_blocks_free_as_they_go(rank: int, mode: str = "graph") -> dict:
    """An exported HF BERT, one FSDP2 unit per layer: layer 0's parameters are shards
    again by the time layer 1 starts (its unit completes after its last module, not at
    the end of the whole forward); it trains and cuts. In swap mode a unit is the HF
    layer module itself."""
    import transformers as T
    from torch.distributed.tensor import DTensor

    from tncompile.distributed import block_units, shard
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=500, hidden_size=96, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=384, max_position_embeddings=32, num_labels=2)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(rank))
    compiled = tncompile.compile(T.BertForSequenceClassification(config).eval(), target_ratio=0.3,
                                 example_inputs={"input_ids": ids}, mode=mode)
    blocks = block_units(compiled)
    shard(compiled, units="blocks")
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2, early_steps=None, truncate_every=0)
    gm = compiled if mode == "swap" else compiled.model
    layer0 = gm.get_submodule(blocks[0][0])
    seen = []
    hook = gm.get_submodule(blocks[1][0]).register_forward_pre_hook(
        lambda m, a: seen.append(all(isinstance(p, DTensor) for p in layer0.parameters())))
    compiled.train()
    ratios = []
    for step in range(3):
        loss = compiled(input_ids=ids).logits.logsumexp(-1).mean()
        (loss + ctl.penalty(loss)).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            ctl.truncate(budget=0.8 * compiled.ratio)
        ratios.append(compiled.ratio)
    hook.remove()
    return {"blocks": len(blocks), "freed_before_next": seen, "ratios": ratios,
            "finite": bool(torch.isfinite(loss)), "class": type(compiled).__name__,
            "units": blocks if mode == "swap" else None}


def _mixtral_swap_sharded(rank: int) -> dict:
    """A swap-mode Mixtral (fused experts behind their owner's properties) under FSDP2, one
    unit per decoder layer: it trains, the experts' cores get gradients on every process,
    and a cut keeps the processes' ranks equal."""
    import transformers as T

    from tncompile.distributed import shard
    from tncompile.runtime.layers.experts import TTExperts
    torch.manual_seed(0)
    config = T.MixtralConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             num_local_experts=4, num_experts_per_tok=2)
    ids = torch.randint(1, 500, (2, 8), generator=torch.Generator().manual_seed(rank))
    compiled = tncompile.compile(T.MixtralForCausalLM(config).eval(), target_ratio=0.3,
                                 example_inputs={"input_ids": ids}, mode="swap")
    shard(compiled, units="blocks")
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3, gate_lr=1e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.2, early_steps=None, truncate_every=0)
    compiled.train()
    experts = [m for m in compiled.modules() if isinstance(m, TTExperts)]
    ratios, expert_grads = [], []
    for step in range(3):
        loss = compiled(input_ids=ids, labels=ids).loss
        (loss + ctl.penalty(loss)).backward()
        expert_grads.append(all(c.grad is not None for e in experts for c in e.cores))
        opt.step()
        opt.zero_grad()
        if step == 1:
            ctl.truncate(budget=0.8 * compiled.ratio)
        ratios.append(compiled.ratio)
    ranks = [list(e.layout.ranks) for e in experts]
    return {"finite": bool(torch.isfinite(loss)), "ratios": ratios, "experts": len(experts),
            "expert_grads": expert_grads, "ranks": ranks}


def _fsdp2_cuts(rank: int, out: Path) -> dict:
    """FSDP2 with rank cuts by gather -> cut -> reshard, against DDP: root-only (MLP) and one
    unit per encoder block (reshard_after_forward=False: bitwise; True: the gates' penalty
    gradient joins after the reduce-scatter, so within rounding); saving gathers the shards."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from tncompile.distributed import block_units, shard
    report = {}
    for name, model, kwargs in (("root", "mlp", dict(units="root")),
                                ("blocks", "encoder", dict(units="blocks", reshard_after_forward=False)),
                                ("blocks_resharded", "encoder", dict(units="blocks"))):
        ddp = _cut_run(rank, model, DistributedModel)
        fsdp = _cut_run(rank, model, lambda c: shard(c, **kwargs))
        units = sum(isinstance(m, FSDPModule) for m in fsdp["compiled"].modules())
        report[name] = {
            "bitwise": [bool(torch.equal(a, b)) for a, b in zip(ddp["weights"], fsdp["weights"])],
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(ddp["weights"], fsdp["weights"])),
            "same_ranks": ddp["ranks"] == fsdp["ranks"], "cuts": fsdp["cuts"], "sharded": fsdp["sharded"],
            "units": units, "blocks": len(block_units(fsdp["compiled"]))}
    # saving a sharded model: every process gathers, rank 0 writes the whole model; shards stay
    compiled, opt, ctl = fsdp["compiled"], fsdp["opt"], fsdp["ctl"]
    from tncompile.distributed import save_on_rank0
    shards = [id(p) for p in compiled.parameters()]
    save_on_rank0(compiled, out / "fsdp.tnc", optimizer=opt, controller=ctl)
    kept = shards == [id(p) for p in compiled.parameters()] and all(
        id(p) in set(shards) for g in opt.param_groups for p in g["params"])
    loaded = tncompile.load(out / "fsdp.tnc", model=small_encoder(max_len=16))
    same_weights = torch.equal(torch.cat([_full(p) for p in compiled.parameters()]), _flat(loaded))
    # resuming it sharded: load, optimizer, resume, then shard with the optimizer (its state moves onto the shards)
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    ctl2 = tncompile.RankController(loaded, opt2, target_ratio=0.15, early_steps=4, late_steps=8, truncate_every=2)
    tncompile.resume(loaded, opt2, ctl2)
    shard(loaded, units="blocks", optimizer=opt2)

    def full_states(o, model):
        return torch.cat([_full(o.state[p]["exp_avg_sq"]) for p in model.parameters()])
    resumed_state = torch.equal(full_states(opt2, loaded), full_states(opt, compiled)) and ctl2.steps_done == 12
    try:
        tncompile.save(compiled, out / "plain.tnc")
        plain_save = None
    except ValueError as e:
        plain_save = str(e)
    x, y = _encoder_batches(rank)[0]
    F.cross_entropy(compiled(x), y).backward()  # trains on after the save
    opt.step()
    # fully_shard applied directly: tncompile does not know how to re-shard after a cut
    direct, d_opt, d_ctl = _setup()
    fully_shard(direct)
    try:
        d_ctl.truncate()
        refused = None
    except NotImplementedError as e:
        refused = str(e)
    report["whole"] = _whole_matches_full_tensor()
    report["bert"] = _bert_blocks_free_as_they_go(rank)
    report["bert_swap"] = _bert_blocks_free_as_they_go(rank, mode="swap")
    report["mixtral_swap"] = _mixtral_swap_sharded(rank)
    report["save"] = {"kept_shards": kept, "same_weights": bool(same_weights), "plain_save": plain_save,
                      "resumed_state": bool(resumed_state),
                      "refused": refused}
    return report


def _world_sizes(rank: int, out: Path) -> dict:
    """A 1-process checkpoint resumed on 2 processes (a warning; rank 1 gets a stream of its
    own); a controller agreeing over fewer processes than DDP averages over, and one built
    on another model: clear errors."""
    import warnings

    from tncompile.train import TrainStep
    compiled, opt, ctl = _setup()
    torch.manual_seed(77)
    saved = torch.get_rng_state()
    if rank == 0:
        tncompile.save(compiled, out / "one.tnc", optimizer=opt, controller=ctl, extra={"rng_per_rank": [saved]})
    dist.barrier()
    loaded = tncompile.load(out / "one.tnc", model=mlp((64, 256, 256, 10)))
    opt2 = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tncompile.resume(loaded, opt2)
    streams = [torch.empty_like(saved) for _ in range(WORLD)]
    dist.all_gather(streams, torch.get_rng_state())
    groups = [dist.new_group([r]) for r in range(WORLD)]  # every process takes part in creating each
    lonely = tncompile.RankController(compiled, opt, target_ratio=0.12, process_group=groups[rank])
    errors = {}
    for name, make in (("mixed", lambda: TrainStep(DistributedModel(compiled), opt, F.cross_entropy, controller=lonely)),
                       ("other_model", lambda: TrainStep(DistributedModel(loaded), opt2, F.cross_entropy,
                                                         controller=ctl))):
        try:
            make()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return {"warned": [str(w.message) for w in caught if "written by 1 process" in str(w.message)],
            "rank0_restored": bool(torch.equal(streams[0], saved)), "streams_differ": not torch.equal(*streams),
            **errors}


def _dropout_ddp(rank: int, out: Path) -> dict:
    compiled, opt, ctl = _dropout_setup()
    model = DistributedModel(compiled)
    torch.manual_seed(1000 + rank)  # each rank draws its own dropout masks
    identical = [_ddp_step(model, opt, ctl, x, y) for x, y in _batches(rank)]
    return {"identical": identical, "params": _flat(compiled).tolist()}


def _fsdp2_kept_forms(rank: int, out: Path) -> dict:
    """An FSDP2 model (one unit per block, resharded after forward) kept in eval mode throughout:
    after each update of its shards its outputs without autograd (merged forms kept by the
    layers, made from the gathered tensors) equal its outputs with autograd (contracted afresh)."""
    from tncompile.distributed import shard
    from tncompile.testing import small_encoder
    torch.manual_seed(0)
    compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3)
    shard(compiled, units="blocks")
    compiled.eval()
    batches = _encoder_batches(rank, steps=3)
    x = batches[0][0]

    def outputs():
        with torch.no_grad():
            kept = compiled(x)
        return kept, compiled(x).detach()

    def check(before):
        kept, fresh = outputs()
        return {"changed": float((kept - before).abs().max()) > 1e-3, "current": float((kept - fresh).abs().max())}

    result = {}
    before = outputs()[0]
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for xb, yb in batches:
        F.cross_entropy(compiled(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    result["adamw"], before = check(before), outputs()[0]
    saved = {k: v.detach().clone() for k, v in compiled.state_dict().items()}
    with torch.no_grad():
        for p in compiled.parameters():
            p.mul_(1.3)
    result["in_place"], before = check(before), outputs()[0]
    compiled.load_state_dict(saved)
    result["load_state_dict"] = check(before)
    return result


def _own_loop(rank: int, out: Path) -> dict:
    """One process start for four checks (starting processes costs more than they do)."""
    return {"train": _train_ddp(rank, out), "comera": _comera_choices(rank, out), "mismatch": _mismatch(rank, out),
            "paths": _every_runtime_path(rank, out), "fsdp2": _fsdp2_cuts(rank, out),
            "world_sizes": _world_sizes(rank, out), "dropout": _dropout_ddp(rank, out),
            "kept_forms": _fsdp2_kept_forms(rank, out), "from_meta": _fsdp2_from_meta(rank, out)}


def _meta_compiled():
    """The MLP built and compiled on the meta device: no memory yet."""
    with torch.device("meta"):
        model = mlp((64, 256, 256, 10))
    return tncompile.compile(model, target_ratio=0.3, init="random")


def _network_values(compiled) -> torch.Tensor:
    from tncompile.runtime.layers import TNModule
    return torch.cat([_full(t) for m in compiled.modules() if isinstance(m, TNModule) for t in m.network_tensors()])


def _fsdp2_from_meta(rank: int, out: Path) -> dict:
    """Issue 56: compile on meta, shard (FSDP2), materialize, train with rank cuts."""
    import math

    from torch.distributed.tensor import DTensor

    from tncompile.distributed import shard
    compiled = _meta_compiled()
    shard(compiled, units="root")                       # the mesh: the CPU here (the parameters are on meta)
    tncompile.materialize(compiled, "cpu", seed=0)
    sharded = all(isinstance(p, DTensor) and not p.is_meta for p in compiled.parameters())
    values = _network_values(compiled)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.12, early_steps=8, late_steps=16,
                                   truncate_every=4, recovery=0.25)
    cuts, losses = 0, []
    for x, y in _batches(rank):
        task = F.cross_entropy(compiled(x), y)
        (task + ctl.penalty(task)).backward()
        opt.step()
        opt.zero_grad()
        cuts += bool(ctl.step().shapes_changed)
        losses.append(task.item())
    return {"sharded": sharded, "values": values.tolist(), "cuts": cuts,
            "ranks": {k: list(v) for k, v in ctl.ranks().items()},
            "finite": all(math.isfinite(v) for v in losses), "learned": losses[-1] < losses[0]}


def _dropout_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _dropout_setup():
    torch.manual_seed(0)
    compiled = tncompile.compile(_dropout_model(), target_ratio=0.3)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.12, early_steps=8, late_steps=16,
                                   truncate_every=4, recovery=0.25)
    return compiled, opt, ctl


def _resume_is_exact(rank: int, out: Path) -> dict:
    """Uninterrupted 24 steps vs. loading the step-12 checkpoint, resuming and going on."""
    import shutil

    def keep_step_12(model):  # eval_fn at step 24 runs before that step's save: the file holds step 12
        if rank == 0:
            shutil.copy(out / "run.tnc", out / "half.tnc")
        return 0.0

    kwargs = dict(early_steps=8, late_steps=16, ddp={}, progress=False)
    compiled, opt, ctl = _dropout_setup()
    torch.manual_seed(1000 + rank)  # each rank draws its own dropout masks
    tncompile.fit(compiled, _batches(rank), F.cross_entropy, opt, ctl, checkpoint_path=out / "run.tnc",
                  checkpoint_every=12, eval_fn=keep_step_12, eval_every=24, **kwargs)
    uninterrupted = _flat(compiled)
    dist.barrier()
    torch.manual_seed(12345)  # whatever the process drew since: resume must restore each rank's stream
    loaded = tncompile.load(out / "half.tnc", model=_dropout_model)
    opt = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(loaded, opt, target_ratio=0.12, early_steps=8, late_steps=16, truncate_every=4,
                                   recovery=0.25)
    extra = tncompile.resume(loaded, opt, ctl)
    assert ctl.steps_done == 12
    tncompile.fit(loaded, _batches(rank), F.cross_entropy, opt, ctl, history=extra["history"], **kwargs)
    return {"exact": bool(torch.equal(_flat(loaded), uninterrupted)), "same_on_all": _same_on_all(_flat(loaded))}


def _distilled(rank: int, out: Path, mode: str = "graph") -> dict:
    """fit(teacher=..., ddp={}) with rank cuts on unlabeled batches: replicas stay identical,
    the student gets closer to the teacher, the teacher is untouched (graph or swap mode)."""
    torch.manual_seed(0)
    teacher = mlp((64, 256, 256, 10)).eval()
    before = [p.detach().clone() for p in teacher.parameters()]
    compiled = tncompile.compile(teacher, target_ratio=0.3, mode=mode)
    opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(compiled, opt, target_ratio=0.15, early_steps=8, late_steps=16,
                                   truncate_every=4, recovery=0.25)
    inputs = [x for x, _ in _batches(rank)]
    probe = torch.randn(64, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        gap = float((compiled(probe) - teacher(probe)).pow(2).mean())
    history = tncompile.fit(compiled, inputs, None, opt, ctl, 8, 16, teacher=teacher, ddp={}, progress=False)
    with torch.no_grad():
        after = float((compiled(probe) - teacher(probe)).pow(2).mean())
    return {"identical": _same_on_all(_flat(compiled)), "closer": after < gap, "steps": len(history.step),
            "cut": any(e["kind"] == "truncation" for e in history.events),
            "teacher_same": all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))}


def _checkpoints(rank: int, out: Path) -> dict:
    (out / "a").mkdir(exist_ok=True)
    (out / "b").mkdir(exist_ok=True)
    return {"fit": _fit_with_checkpoint(rank, out / "a"), "resume": _resume_is_exact(rank, out / "b"),
            "distill": _distilled(rank, out), "distill_swap": _distilled(rank, out, mode="swap")}


SCENARIOS = {"own_loop": _own_loop, "checkpoints": _checkpoints}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    return out, _run("checkpoints", out)


@pytest.mark.slow
def test_resume_from_a_two_process_checkpoint_is_bitwise_the_uninterrupted_run(checkpoints):
    for r in checkpoints[1]:
        assert r["resume"]["same_on_all"] and r["resume"]["exact"]


@pytest.fixture(scope="module")
def own_loop(tmp_path_factory):
    return _run("own_loop", tmp_path_factory.mktemp("ddp"))


def _run(scenario: str, tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    ctx = mp.start_processes(_worker, args=(_free_port(), scenario, str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed scenario {scenario!r} did not finish in {timeout:.0f} s (a hang)")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_replicas_stay_identical_across_cuts_and_equal_one_process(own_loop):
    results = [r["train"] for r in own_loop]
    for r in results:
        assert all(r["identical"]), "replicas diverged"
        assert r["rebuilds"] >= 2, "the DDP wrapper was not rebuilt after the cuts"
        assert r["stage"] == "late" and r["ratio"] <= 0.12
    assert results[0]["ranks"] == results[1]["ranks"]
    # one process taking both micro-batches of every step and averaging their gradients
    # (each micro-batch's gradient of task + penalty, halved and summed: what DDP's all-reduce computes)
    compiled, opt, ctl = _single_threaded(_one_process_reference)
    assert {k: list(v) for k, v in ctl.ranks().items()} == results[0]["ranks"]
    assert torch.equal(_flat(compiled), torch.tensor(results[0]["params"])), "not bitwise equal to one process"


def _one_process_reference(setup=None, seeds=None):
    """One process, both micro-batches of every step, their gradients halved and summed
    (what DDP's all-reduce computes). ``seeds``: each micro-batch draws its dropout
    masks from its own random stream, swapped in around its forward (as each rank's)."""
    compiled, opt, ctl = (setup or _setup)()
    streams = []
    for seed in seeds or ():
        torch.manual_seed(seed)
        streams.append(torch.get_rng_state())
    for (x0, y0), (x1, y1) in zip(_batches(0), _batches(1)):
        tasks = []
        for r, (x, y) in enumerate(((x0, y0), (x1, y1))):
            if streams:
                torch.set_rng_state(streams[r])
            tasks.append(F.cross_entropy(compiled(x), y))
            if streams:
                streams[r] = torch.get_rng_state()
        agreed = (tasks[0].detach() + tasks[1].detach()) / 2
        penalty = ctl.penalty(agreed)
        params = [p for p in compiled.parameters() if p.requires_grad]
        grads = [torch.autograd.grad(t + penalty, params, retain_graph=True) for t in tasks]
        for p, g0, g1 in zip(params, *grads):
            p.grad = g0 / 2 + g1 / 2
        opt.step()
        opt.zero_grad()
        ctl.step()
    return compiled, opt, ctl


def _single_threaded(fn):
    """``fn()`` as a worker runs it: one thread (a GEMM's sums depend on how its threads split
    it), and each layer's way the prior's (a process of several times nothing:
    runtime/ways/measured.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tncompile.tuning.override(MEASURE_WAYS=False):
            return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_with_dropout_two_processes_equal_one_process_swapping_streams(own_loop):
    compiled, _, _ = _single_threaded(lambda: _one_process_reference(_dropout_setup, seeds=(1000, 1001)))
    for r in own_loop:
        assert all(r["dropout"]["identical"])
    assert torch.equal(_flat(compiled), torch.tensor(own_loop[0]["dropout"]["params"])), \
        "not bitwise equal to one process drawing each rank's masks from its stream"
    same_stream, _, _ = _single_threaded(lambda: _one_process_reference(_dropout_setup, seeds=(1000, 1000)))
    assert not torch.equal(_flat(same_stream), _flat(compiled)), "dropout drew no masks: the check is void"


def test_one_forward_over_the_global_batch_agrees_with_averaged_micro_batches():
    """What DDP computes (the mean of the micro-batches' gradients of task + penalty, the
    penalty taken at the averaged loss) against one forward over both micro-batches."""
    compiled, opt, ctl = _setup()
    (x0, y0), (x1, y1) = _batches(0)[0], _batches(1)[0]
    params = [p for p in compiled.parameters() if p.requires_grad]
    tasks = [F.cross_entropy(compiled(x), y) for x, y in ((x0, y0), (x1, y1))]
    penalty = ctl.penalty((tasks[0].detach() + tasks[1].detach()) / 2)
    micro = [torch.autograd.grad(t + penalty, params, retain_graph=True) for t in tasks]
    task = F.cross_entropy(compiled(torch.cat([x0, x1])), torch.cat([y0, y1]))
    whole = torch.autograd.grad(task + ctl.penalty(task.detach()), params)
    for g0, g1, g in zip(*micro, whole):
        torch.testing.assert_close(g0 / 2 + g1 / 2, g, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_every_runtime_path_keeps_replicas_identical(own_loop):
    for r in own_loop:
        assert all(r["paths"]["identical"])
        assert {"TTMEmbedding", "TTLinear", "FastDropout"} <= set(r["paths"]["kinds"])


@pytest.mark.slow
def test_fsdp2_cuts_by_gather_cut_reshard_equal_ddp(own_loop):
    for r in own_loop:
        fsdp = r["fsdp2"]
        for name in ("root", "blocks", "blocks_resharded"):
            run = fsdp[name]
            assert run["same_ranks"] and run["cuts"] >= 2, name
            assert run["sharded"] and all(run["sharded"]), f"{name}: not re-sharded after a cut"
        assert all(fsdp["root"]["bitwise"]) and all(fsdp["blocks"]["bitwise"])
        assert fsdp["blocks_resharded"]["max_diff"] < 1e-3
        assert fsdp["root"]["units"] == 1 and fsdp["blocks"]["blocks"] == 2 and fsdp["blocks"]["units"] > 2


def test_fsdp2_from_the_meta_device_materializes_and_trains_with_cuts(own_loop):
    """fully_shard on a meta-compiled model, then materialize: each process holds its shards of
    the values one process draws (seeded alike), training cuts ranks alike on both."""
    want = _network_values(tncompile.materialize(_meta_compiled(), "cpu", seed=0))
    results = [r["from_meta"] for r in own_loop]
    for r in results:
        assert r["sharded"] and r["finite"] and r["learned"] and r["cuts"] >= 1, {k: r[k] for k in ("cuts", "finite")}
        assert torch.equal(torch.tensor(r["values"]), want)
    assert results[0]["ranks"] == results[1]["ranks"]


def test_fsdp2_updates_reach_outputs_without_autograd(own_loop):
    """Kept inference forms follow FSDP2's re-gathered tensors (tests/test_kept_forms.py: one process)."""
    for r in own_loop:
        for update, got in r["kept_forms"].items():
            assert got["changed"] and got["current"] < 1e-5, (update, got)


@pytest.mark.slow
def test_fsdp2_saves_whole_and_refuses_what_it_cannot_reshard(own_loop):
    for r in own_loop:
        save = r["fsdp2"]["save"]
        assert save["kept_shards"] and save["same_weights"] and save["resumed_state"]
        assert "save_on_rank0" in save["plain_save"]
        assert "tncompile.distributed.shard" in save["refused"]
        for bert in (r["fsdp2"]["bert"], r["fsdp2"]["bert_swap"]):       # graph mode and swap mode
            assert bert["blocks"] == 2 and bert["finite"] and bert["freed_before_next"] == [True] * 3
            assert bert["ratios"][2] < bert["ratios"][0]
        swapped = r["fsdp2"]["bert_swap"]
        assert swapped["class"].endswith("BertForSequenceClassification")   # FSDP2 prefixes its class name
        assert swapped["units"] == [["bert.encoder.layer.0"], ["bert.encoder.layer.1"]]
        assert r["fsdp2"]["whole"] == {"values": True, "full": True, "grads": True, "sums": True, "sum_grad": True}
    moe = [r["fsdp2"]["mixtral_swap"] for r in own_loop]                   # swap-mode experts, sharded
    for m in moe:
        assert m["finite"] and m["experts"] >= 2 and all(m["expert_grads"]) and m["ratios"][2] < m["ratios"][0]
    assert moe[0]["ranks"] == moe[1]["ranks"]


@pytest.mark.slow
def test_late_stage_choices_agree_on_every_process(own_loop):
    results = [r["comera"] for r in own_loop]
    assert results[0]["choices"] and results[0]["agreed"] and results[1]["agreed"]
    assert results[0]["choices"] == results[1]["choices"]


@pytest.mark.slow
def test_mismatched_cuts_raise_on_every_process(own_loop):
    results = [r["mismatch"] for r in own_loop]
    for r in results:
        assert r["raised"] and "differ between processes" in r["raised"]


@pytest.mark.slow
def test_fit_with_ddp_checkpoints_from_rank0_and_restores_each_rank_stream(checkpoints):
    tmp_path, results = checkpoints[0] / "a", [r["fit"] for r in checkpoints[1]]
    for r in results:
        assert r["identical"] and r["steps"] == 24 and r["ratio"] <= 0.12
        assert r["own_rng_restored"] and r["streams_differ"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tnc") == ["ckpt.tnc"]
    # the 2-process checkpoint resumes in one process too (it then keeps rank 0's stream)
    loaded = tncompile.load(tmp_path / "ckpt.tnc", model=mlp((64, 256, 256, 10)))
    opt = torch.optim.AdamW(tncompile.param_groups(loaded, lr=3e-3, gate_lr=3e-2))
    ctl = tncompile.RankController(loaded, opt, target_ratio=0.12, early_steps=8, late_steps=16, truncate_every=4,
                                   recovery=0.25)
    extra = tncompile.resume(loaded, opt, ctl)
    assert ctl.steps_done == 24 and torch.equal(torch.get_rng_state(), extra["rng_per_rank"][0])
    x, y = _batches(0)[12]
    F.cross_entropy(loaded(x), y).backward()
    opt.step()


@pytest.mark.slow
def test_distillation_under_ddp_keeps_replicas_identical_through_cuts(checkpoints):
    for r in checkpoints[1]:
        for d in (r["distill"], r["distill_swap"]):                 # DDP over a swap-mode model too
            assert d["identical"] and d["closer"] and d["cut"] and d["teacher_same"] and d["steps"] == 24


@pytest.mark.slow
def test_other_world_sizes_resume_with_a_warning_and_mixed_groups_are_refused(own_loop):
    for r in own_loop:
        w = r["world_sizes"]
        assert w["warned"] and "not bit-identical" in w["warned"][0] and "this run has 2" in w["warned"][0]
        assert w["rank0_restored"] and w["streams_differ"]
        assert "agrees over 1 process(es) but DistributedModel averages gradients over 2" in w["mixed"]
        assert "built for a different model" in w["other_model"]


def test_ddp_without_a_process_group_is_a_clear_error():
    compiled, opt, ctl = _setup()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        tncompile.fit(compiled, _batches(0), F.cross_entropy, opt, ctl, early_steps=1, late_steps=1, ddp={})
    with pytest.raises(RuntimeError, match="DistributedModel: torch.distributed is not initialized"):
        DistributedModel(compiled)
    with pytest.raises(TypeError, match="ddp must be a dict"):
        tncompile.fit(compiled, _batches(0), F.cross_entropy, opt, ctl, early_steps=1, late_steps=1, ddp=True)


@pytest.fixture
def one_process_group():
    """A world of one (gloo, in-memory store): DDP and DistributedModel in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_capture_needs_are_met_and_checked_in_the_fake_cuda_dry_run(one_process_group):
    """PyTorch's CUDA-graph notes for DDP: build it on a side stream, run 11 eager DDP
    iterations before capture -- and, after a cut builds a new DDP wrapper, again."""
    from tncompile.train import TrainStep
    from tncompile.train.capture_cache import CaptureCache
    compiled, opt, ctl = _setup()
    model = DistributedModel(compiled)
    x, y = _batches(0)[0]
    report = tncompile.dry_run(model, opt, F.cross_entropy, x, y, controller=ctl)
    assert report.ok, str(report)
    assert any("11 eager DDP steps" in n and "after every cut" in n for n in report.notes)
    plain = tncompile.dry_run(torch.nn.parallel.DistributedDataParallel(compiled), opt, F.cross_entropy, x, y,
                              controller=ctl)
    assert [h.kind for h in plain.hazards] == ["ddp"] and "DistributedModel" in str(plain)
    assert TrainStep(model, opt, F.cross_entropy, controller=ctl).cache.warmup_steps == 11
    assert TrainStep(compiled, opt, F.cross_entropy, controller=ctl).cache.warmup_steps == 2
    assert TrainStep(model, opt, F.cross_entropy, controller=ctl, warmup_steps=20).cache.warmup_steps == 20
    # the cache TrainStep consults: 11 eager steps, a capture, then (a cut changes the state token) 11 again
    cache = CaptureCache(warmup_steps=11)
    for _ in range(2):
        cache.check_token(object())
        decisions = []
        for _ in range(12):
            decisions.append(cache.decide("sig"))
            if decisions[-1] == "eager":
                cache.warmed("sig")
        assert decisions == ["eager"] * 11 + ["capture"]


def test_ddp_is_built_on_the_capture_stream_now_and_after_every_cut(one_process_group, monkeypatch):
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    side, main = Stream("side"), Stream("main")
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    real_ddp = torch.nn.parallel.DistributedDataParallel

    class RecordingDDP(real_ddp):
        def __init__(self, *args, **kwargs):
            events.append(f"DDP built on {current[-1].name}")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", RecordingDDP)
    compiled, opt, ctl = _setup()
    model = DistributedModel(compiled)
    assert events == ["DDP built on main"]  # CPU parameters and no stream given: built in place
    events.clear()
    model.use_stream(side)  # what TrainStep does when it captures
    model.after_step(type("Cut", (), {"shapes_changed": True})())
    assert events == ["side waits for main", "DDP built on side", "main waits for side"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_the_example_trains_under_torchrun(tmp_path, mode):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "examples" / "ddp.py"), "--steps", "20", "--batch", "16", "--out", str(tmp_path)]
    run = subprocess.run(cmd + (["--fsdp2"] if mode == "fsdp2" else []), capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"2 processes ({mode.upper()})" in run.stdout
    example_model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                        torch.nn.GELU(), torch.nn.Linear(1024, 10))  # examples/ddp.py's
    loaded = tncompile.load(tmp_path / "ddp.tnc", model=example_model)
    assert loaded.ratio <= 0.021 and "FSDP" not in type(loaded).__name__


def test_shard_refuses_bad_input_clearly_and_leaves_the_model_alone(one_process_group, tmp_path):
    from tncompile.distributed import is_sharded, shard
    compiled, opt, ctl = _setup()
    before = _flat(compiled).clone()
    with pytest.raises(TypeError, match="shard expects the model tncompile.compile returned"):
        shard(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="units must be 'blocks', 'root' or a list of block names"):
        shard(compiled, units=3)
    with pytest.raises(ValueError, match=r"units \['layers.9'\] are not modules of the compiled model"):
        shard(compiled, units=["layers.9"])
    with pytest.raises(TypeError, match=r"fully_shard takes no \['reshard_after_fwd'\]; its keyword arguments"):
        shard(compiled, reshard_after_fwd=True)
    assert not is_sharded(compiled) and torch.equal(_flat(compiled), before)
    shard(compiled, units="root", optimizer=opt)  # an optimizer built before: moved onto the shards
    assert is_sharded(compiled) and all(id(p) in {id(q) for q in compiled.parameters()}
                                        for g in opt.param_groups for p in g["params"])
    with pytest.raises(ValueError, match="already sharded"):
        shard(compiled)
    with pytest.raises(ValueError, match="save_on_rank0"):
        tncompile.save(compiled, tmp_path / "m.tnc")
    with pytest.raises(ValueError, match="sharded by FSDP2, which reduces its gradients itself; leave out ddp="):
        tncompile.fit(compiled, _batches(0), F.cross_entropy, opt, ctl, early_steps=1, late_steps=1, ddp={})
    from tncompile.train import TrainStep
    with pytest.raises(ValueError, match="cuda_graph=True with an FSDP2-sharded model is not supported"):
        TrainStep(compiled, opt, F.cross_entropy, controller=ctl, cuda_graph=True)
    step = TrainStep(compiled, opt, F.cross_entropy, controller=ctl)  # "auto": eager
    x, y = _batches(0)[0]
    assert not step.use_graphs and torch.isfinite(step(x, y))


def test_shard_needs_a_process_group():
    from tncompile.distributed import shard
    compiled, _, _ = _setup()
    with pytest.raises(RuntimeError, match="shard: torch.distributed is not initialized"):
        shard(compiled)
