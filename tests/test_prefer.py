"""compile(prefer=...): no network slower to train than its dense layer by default,
judged in estimated time (multiply-adds, memory traffic and the fixed cost of every
kernel on the device), not in multiply-adds alone; the report says when."""
import json
from dataclasses import replace

import pytest
import torch
from torch import nn

import tncompile
from tncompile import tuning
from tncompile.formats.layout import TTLayout
from tncompile.passes.assign_ranks import AssignRanks
from tncompile.planning import REFERENCE, DeviceSpeed, device_speed, fixed_order_macs, fixed_order_plan
from tncompile.planning import speed_model as speed_module
from tncompile.runtime import TTLinear


@pytest.fixture(autouse=True)
def _reference_speed(monkeypatch):
    """These tests plan with the reference CPU, fixed costs included (the rest of the
    suite makes kernels free)."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", REFERENCE)
    yield


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def _tt_layers(compiled):
    return {name: m for name, m in compiled.tensorized_modules().items() if isinstance(m, TTLinear)}


def _step_seconds(layout: TTLayout, rows: int, speed: DeviceSpeed = REFERENCE) -> tuple[float, float]:
    plan = fixed_order_plan(layout, rows)
    return (speed.network_step_seconds(plan, layout.in_features, layout.out_features),
            speed.dense_step_seconds(rows, layout.in_features, layout.out_features))


def _within_margin(layer: TTLinear, rows: int, speed: DeviceSpeed = REFERENCE) -> bool:
    tt, dense = _step_seconds(layer.layout, rows, speed)
    return tt <= tuning.SPEED_MARGIN * dense


def _speed_rule_holds(compiled, rows: int, speed: DeviceSpeed = REFERENCE) -> None:
    """Every network is within the margin of its dense layer's time or, slower as TT
    at every rank and kept for the target, costs at most its dense layer's multiply-adds."""
    notes = {r.name: r.note for r in compiled.report().rows}
    for name, layer in _tt_layers(compiled).items():
        if "kept as TT to reach target_ratio" in notes[name]:
            lay = layer.layout
            tt1, dense = _step_seconds(lay.with_ranks(1), rows, speed)
            assert tt1 > tuning.SPEED_MARGIN * dense
            assert fixed_order_macs(lay, rows) <= 3 * rows * lay.in_features * lay.out_features, name
        else:
            assert _within_margin(layer, rows, speed), (name, layer.layout.ranks)


#: kernels cost nothing: time follows multiply-adds and bytes
FREE_KERNELS = replace(REFERENCE, kernel_seconds=1e-12, dense_call_seconds=1e-12)
#: every kernel costs a millisecond: a 3-core network's ~18 kernels lose to one dense layer's 3 GEMMs
SLOW_KERNELS = replace(REFERENCE, kernel_seconds=1e-3)


@pytest.mark.parametrize("traced_rows", [1, 32])
def test_speed_keeps_every_network_within_the_margin_of_dense(traced_rows):
    """Over a batch of 32 samples (tuning.ASSUMED_ROWS) at the rows per sample traced,
    whatever batch the example inputs had: the ranks do not depend on it."""
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(traced_rows, 256),))
    assert compiled.ratio <= 0.05
    layers = _tt_layers(compiled)
    assert layers
    _speed_rule_holds(compiled, 32)
    other = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(33 - traced_rows, 256),))
    assert {n: m.layout.ranks for n, m in _tt_layers(other).items()} == \
        {n: m.layout.ranks for n, m in layers.items()}


def test_a_layer_faster_in_flops_but_slower_in_time_stays_dense(monkeypatch):
    """At 32 rows every rank-1 network here needs far fewer multiply-adds than its
    dense layer; where kernels are expensive it is still slower, so it stays dense
    (as far as target_ratio allows), and the report says why. Where kernels are
    free the same layers are networks."""
    x = torch.randn(32, 256)
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SLOW_KERNELS)
    slow = tncompile.compile(_mlp(), target_ratio=0.5, example_inputs=(x,))
    kept = [r.name for r in slow.report().rows if r.format == "dense" and r.note.startswith("kept dense")]
    assert kept, str(slow.report())
    assert slow.ratio <= 0.5
    assert not set(kept) & set(_tt_layers(slow))
    for name in kept:
        assert type(slow.model.get_submodule(name)) is nn.Linear
        lay = TTLayout.for_shape(*{"0": (256, 512), "2": (512, 512), "4": (512, 8)}[name], 3).with_ranks(1)
        assert fixed_order_macs(lay, 32) < 3 * 32 * lay.in_features * lay.out_features  # faster in FLOPs ...
        tt, dense = _step_seconds(lay, 32, SLOW_KERNELS)
        assert tt > dense  # ... slower in time
    monkeypatch.setattr(tuning, "DEVICE_SPEED", FREE_KERNELS)
    free = tncompile.compile(_mlp(), target_ratio=0.5, example_inputs=(x,))
    assert "0" in _tt_layers(free) and "4" in _tt_layers(free)
    assert kept == ["4"]  # the 512 -> 8 head: "0" and "2" hold more than 25% of the budget
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SLOW_KERNELS)
    monkeypatch.setattr(tuning, "DENSE_FOR_SPEED_SHARE", 1.0)
    lifted = tncompile.compile(_mlp(), target_ratio=0.5, example_inputs=(x,))
    assert "0" not in _tt_layers(lifted) and lifted.ratio <= 0.5


def test_slower_layers_the_model_can_absorb_keep_their_rank(monkeypatch):
    """A tiny head slower as TT by less than 5% of the model's dense step time
    (tuning.SPEED_SLACK) keeps the rank the budget gives it, within dense's
    multiply-adds, and the report says it is slower."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))
    compiled = tncompile.compile(model, target_ratio=0.05)
    head = _tt_layers(compiled)["4"]
    tt, dense = _step_seconds(head.layout, 32)
    assert tt > dense and max(head.layout.ranks) > 2
    assert fixed_order_macs(head.layout, 32) <= 3 * 32 * 2048 * 10
    note = {r.name: r.note for r in compiled.report().rows}["4"]
    assert "slower than dense at 32 rows" in note and "absorbed" in note
    monkeypatch.setattr(tuning, "SPEED_SLACK", 0.0)
    strict = tncompile.compile(model, target_ratio=0.05)
    assert "4" not in _tt_layers(strict)


def test_target_ratio_still_holds_when_keeping_layers_dense_cannot_reach_it(monkeypatch):
    """Every layer is slower as a network, but at 0.05 none can stay dense: all are
    networks, the target is met and the report names the ones kept for it."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SLOW_KERNELS)
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),))
    assert compiled.ratio <= 0.05
    assert {"0", "2"} <= set(_tt_layers(compiled))
    notes = {r.name: r.note for r in compiled.report().rows}
    assert all("kept as TT to reach target_ratio" in notes[n] for n in ("0", "2"))
    _speed_rule_holds(compiled, 32, SLOW_KERNELS)


def test_dearer_kernels_get_lower_ranks(monkeypatch):
    """Planned for 512-sample batches with a budget that does not bind: where
    kernels cost their measured time, some network is capped lower than where
    they are free."""
    def rank():
        torch.manual_seed(0)
        compiled = tncompile.compile(nn.Sequential(nn.Linear(512, 512)), target_ratio=0.9, batch_sizes=[512])
        return max(_tt_layers(compiled)["0"].layout.ranks)
    monkeypatch.setattr(tuning, "DEVICE_SPEED", FREE_KERNELS)
    free = rank()
    monkeypatch.setattr(tuning, "DEVICE_SPEED", replace(REFERENCE, kernel_seconds=40e-6))
    dear = rank()
    assert dear < free, (dear, free)


def test_batch_sizes_say_which_batch_speed_is_judged_at():
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),), batch_sizes=[1])
    _speed_rule_holds(compiled, 1)


@pytest.mark.parametrize("batch_sizes,rows", [(None, 32), ([4, 256], 256)])
def test_without_shapes_speed_uses_batch_sizes_or_32_rows(batch_sizes, rows):
    """Traced by fx without example_inputs there are no shapes: the rule still holds,
    over the largest of batch_sizes, else tuning.ASSUMED_ROWS (32)."""
    assert tncompile.tuning.ASSUMED_ROWS == 32
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, batch_sizes=batch_sizes)
    _speed_rule_holds(compiled, rows)
    small = tncompile.compile(_mlp(), target_ratio=0.05, batch_sizes=batch_sizes, prefer="size")
    assert any(not _within_margin(layer, rows) for layer in _tt_layers(small).values())


def test_size_grows_ranks_past_that_and_the_report_flags_it():
    x = torch.randn(32, 256)
    fast = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,))
    small = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,), prefer="size")
    slower = [name for name, layer in _tt_layers(small).items() if not _within_margin(layer, 32)]
    assert slower
    assert any(max(_tt_layers(small)[n].layout.ranks) > max(_tt_layers(fast)[n].layout.ranks) for n in slower)
    assert small.ratio <= 0.05 and fast.ratio <= 0.05
    flagged = [n for n, layer in _tt_layers(small).items() if _step_seconds(layer.layout, 32)[0] >
               _step_seconds(layer.layout, 32)[1]]
    report = str(small.report())
    for n in flagged:
        assert "slower than dense at 32 rows: est." in report


def test_report_shows_estimated_step_time_per_row():
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),))
    report = compiled.report()
    text = str(report)
    assert "step/tok (est.)" in text and REFERENCE.device in text
    for row in report.rows:
        if row.format == "TT":
            lay = compiled.tensorized_modules()[row.name].layout
            tt, dense = _step_seconds(lay, 32)
            assert row.time_now == pytest.approx(tt / 32) and row.time_dense == pytest.approx(dense / 32)
            assert f"{row.time_dense * 1e9:,.0f}ns->{row.time_now * 1e9:,.0f}ns" in text


def test_report_sums_the_estimated_step_and_names_the_ratio_with_no_slower_layer(monkeypatch):
    """The report's speed line: the TT linears' estimated step against their dense layers'
    (the per-row estimates times the rows each was planned for), the layers estimated
    slower, and the ratio with those kept dense -- which, asked for with them excluded,
    compiles to a model with no slower layer."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SLOW_KERNELS)
    x = torch.randn(32, 256)
    compiled = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,))
    report = compiled.report()
    summary = report.speed
    timed = [r for r in report.rows if r.time_now is not None]
    assert summary.layers == len(timed) == 2 and summary.device == SLOW_KERNELS.device
    assert summary.seconds == pytest.approx(sum(r.time_now * 32 for r in timed))
    assert summary.dense_seconds == pytest.approx(sum(r.time_dense * 32 for r in timed))
    assert summary.speedup < 1 and set(summary.slower) == {"0", "2"}
    back = sum(r.dense_params - r.params for r in timed)
    assert summary.ratio_without_slower == pytest.approx((report.params + back) / report.original_params)
    text = str(report)
    assert f"{summary.speedup:.2f}x dense" in text and f"gives ratio {summary.ratio_without_slower:.4f}" in text
    kept = tncompile.compile(_mlp(), target_ratio=summary.ratio_without_slower, exclude_modules=list(summary.slower),
                             example_inputs=(x,))
    assert kept.ratio <= summary.ratio_without_slower
    assert kept.report().speed is None or not kept.report().speed.slower
    monkeypatch.setattr(tuning, "DEVICE_SPEED", FREE_KERNELS)
    fast = tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(x,)).report()
    assert fast.speed.speedup > 1 and not {"0", "2"} & set(fast.speed.slower)


#: ops that launch no kernel (views), and the CPU-only host reads of an eager lookup
_NO_KERNEL = {"view", "t", "_unsafe_view", "expand", "unsqueeze", "squeeze", "transpose", "permute", "detach",
              "slice", "select", "alias", "reshape", "min", "max", "_local_scalar_dense", "_unique2"}


@pytest.mark.parametrize("cores", [1, 3, 4])
def test_the_lookup_estimate_counts_the_kernels_pytorchs_ops_launch(cores):
    """lookup_kernels(cores) is the kernel count of a TTM embedding's training step as
    PyTorch's ops run it (CUDA's path: the native CPU kernels off), counted here."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from tncompile.formats import TTMLayout
    from tncompile.planning.speed_model import lookup_kernels
    from tncompile.runtime import TTMEmbedding
    from tncompile.runtime.native import native_kernels

    class Launches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_KERNEL:
                Launches.count += 1
            return func(*args, **(kwargs or {}))
    from tncompile import tuning
    from tncompile.runtime.ways.lookup import LookupWay
    emb = TTMEmbedding(TTMLayout.for_shape(1000, 128, cores, ranks=8))
    ids = torch.randint(0, 1000, (8, 64))
    # the estimate is of the gathered product (the prior's way): a timing may pick the whole table here
    with native_kernels(False), tuning.override(MEASURE_WAYS=False):
        emb(ids).square().sum().backward()  # warm: plans, no gradient buffers left
        emb.zero_grad(set_to_none=True)
        out = emb(ids)
        g = torch.randn_like(out)
        with Launches():
            emb(ids).backward(g)
    assert emb.ran_as is (LookupWay.ONE_TABLE if cores == 1 else LookupWay.GATHERED_PRODUCT)
    assert Launches.count == lookup_kernels(cores)


def test_report_estimates_lookups_and_notes_the_slower_ones(monkeypatch):
    """TTM embeddings get the step/tok column (per id) and, estimated slower than
    nn.Embedding, a note; the speed line counts them, and excluding them removes them."""
    from tncompile.planning import lookup_step_seconds
    monkeypatch.setattr(tuning, "DEVICE_SPEED", SLOW_KERNELS)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    ids = torch.randint(0, 4096, (4, 16))
    report = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids,)).report()
    row = next(r for r in report.rows if r.name == "0")
    assert row.format == "TTM" and row.time_now is not None
    lay = tncompile.compile(model, target_ratio=0.2, example_inputs=(ids,)).tensorized_modules()["0"].layout
    network, dense = lookup_step_seconds(lay, 32 * 16, SLOW_KERNELS)  # 16 ids a sample, 32 samples
    assert row.time_now == pytest.approx(network / 512) and row.time_dense == pytest.approx(dense / 512)
    assert "slower than dense at 512 ids" in row.note and "0" in report.speed.slower
    assert report.speed.layers == sum(r.time_now is not None for r in report.rows)


def test_cached_speeds_are_keyed_by_how_fixed_costs_were_timed():
    """Entries cached before fixed costs were timed eagerly on every device (a CUDA entry
    timed on a replayed graph) have another key, and are measured again."""
    assert speed_module.speed_key(torch.device("cpu")).endswith("|eager")


def test_speed_cap_is_the_first_rank_too_slow():
    """Time is not monotonic in the rank: the cap stops below the first rank over the margin."""
    lay = TTLayout.for_shape(256, 512, 3)
    for rows in (1, 256):
        cap = AssignRanks._speed_cap(lay, rows, FREE_KERNELS)
        assert cap >= 1

        def ok(r):
            tt, dense = _step_seconds(lay.with_ranks(r), rows, FREE_KERNELS)
            return tt <= tuning.SPEED_MARGIN * dense
        assert ok(cap) and ok(1)
        assert cap == max(lay.rank_bounds()) or not ok(cap + 1)
    assert AssignRanks._speed_cap(lay, 32, SLOW_KERNELS) == 0


def test_the_step_estimate_counts_kernels_flops_and_bytes():
    lay = TTLayout.for_shape(256, 512, 3).with_ranks(4)
    plan = fixed_order_plan(lay, 64)
    s = DeviceSpeed("x", gemm_macs_per_s=1e9, copy_bytes_per_s=1e9, kernel_seconds=1e-5, dense_call_seconds=1e-4)
    traffic = 2 * plan.write + 3 * 64 * (256 + 512)
    assert s.network_step_seconds(plan, 256, 512) == pytest.approx(
        plan.kernels * 1e-5 + (plan.fwd_flops + plan.bwd_flops) / 1e9 + 4 * traffic / 1e9)
    assert s.dense_step_seconds(64, 256, 512) == pytest.approx(
        1e-4 + 3 * 64 * 256 * 512 / 1e9 + 4 * (3 * 64 * (256 + 512) + 3 * 256 * 512) / 1e9)


@pytest.mark.parametrize("bad", [{"device": "x"}, {**REFERENCE.as_dict(), "kernel_seconds": -1.0},
                                 {**REFERENCE.as_dict(), "gemm_macs_per_s": float("nan")},
                                 {**REFERENCE.as_dict(), "extra": 1}, [1, 2], {**REFERENCE.as_dict(), "device": 3}])
def test_device_speed_entries_are_checked(bad):
    with pytest.raises((ValueError, TypeError)):
        DeviceSpeed.from_dict(bad)


def test_device_speed_is_measured_once_and_cached(tmp_path, monkeypatch):
    """No override: the CPU is measured, written to the cache file, and read back
    (not re-measured) by the next process; a corrupt entry is measured again."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", None)
    monkeypatch.delenv("TNCOMPILE_DEVICE_SPEED")
    monkeypatch.setenv("TNCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(speed_module, "_measured", {})
    first = device_speed("cpu")
    assert first.gemm_macs_per_s > 1e8 and first.copy_bytes_per_s > 1e8
    assert 1e-7 < first.kernel_seconds < 1e-2 and 1e-7 < first.dense_call_seconds < 1e-1
    cached = json.loads((tmp_path / "device_speed.json").read_text())
    assert [DeviceSpeed.from_dict(v) for v in cached.values()] == [first]
    monkeypatch.setattr(speed_module, "_measured", {})
    calls = []
    monkeypatch.setattr(speed_module, "measure_device_speed", lambda d: calls.append(d) or REFERENCE)
    assert device_speed("cpu") == first and not calls  # from the file
    key = next(iter(cached))
    (tmp_path / "device_speed.json").write_text(json.dumps({key: {**cached[key], "kernel_seconds": "1; rm -rf"}}))
    monkeypatch.setattr(speed_module, "_measured", {})
    assert device_speed("cpu") == REFERENCE and len(calls) == 1
    assert device_speed("meta") == REFERENCE  # nothing to time


def test_device_speed_override_must_be_a_device_speed(monkeypatch):
    monkeypatch.setattr(tuning, "DEVICE_SPEED", {"gemm_macs_per_s": 1})
    with pytest.raises(TypeError, match="tuning.DEVICE_SPEED must be a DeviceSpeed"):
        tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),))


def test_device_speed_from_the_environment_is_checked(monkeypatch):
    """``TNCOMPILE_DEVICE_SPEED`` (JSON, inherited by child processes) is read
    through the same field table; anything else is a clear error."""
    monkeypatch.setattr(tuning, "DEVICE_SPEED", None)
    slow = {**REFERENCE.as_dict(), "kernel_seconds": 1e-3}
    monkeypatch.setenv("TNCOMPILE_DEVICE_SPEED", json.dumps(slow))
    assert device_speed("cpu") == SLOW_KERNELS
    for bad in ("not json", json.dumps({**slow, "kernel_seconds": "__import__('os')"}), json.dumps([1])):
        monkeypatch.setenv("TNCOMPILE_DEVICE_SPEED", bad)
        with pytest.raises(ValueError, match="TNCOMPILE_DEVICE_SPEED must be a JSON object"):
            tncompile.compile(_mlp(), target_ratio=0.05, example_inputs=(torch.randn(32, 256),))


def test_bad_prefer_names_the_choices():
    with pytest.raises(ValueError, match="prefer must be one of"):
        tncompile.compile(_mlp(), target_ratio=0.05, prefer="fast")


def _speed_in_child(cache_dir: str, queue) -> None:
    import os
    os.environ.pop("TNCOMPILE_DEVICE_SPEED", None)
    os.environ["TNCOMPILE_CACHE_DIR"] = cache_dir
    from tncompile.planning import device_speed as speed_of
    queue.put(speed_of("cpu").as_dict())


def test_processes_starting_together_share_one_measurement(tmp_path):
    """Two processes asking at once (DDP ranks compiling the same model): one
    measures under the cache lock, the other reads its figures, so both size
    their networks alike."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_speed_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1]
    assert list(json.loads((tmp_path / "device_speed.json").read_text()).values()) == [got[0]]


#: the fixed costs an H200 showed through an eager host (bench_device_speed --device cuda)
GPU_LIKE = replace(REFERENCE, device="gpu-like (test)", kernel_seconds=84e-6, dense_call_seconds=229e-6)


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 8))


@pytest.mark.parametrize("mode", ["graph", "swap"])
def test_compile_warns_when_the_ratio_needs_slower_layers_and_names_the_ratio_that_does_not(monkeypatch, mode):
    """On a device with GPU-like fixed costs, target_ratio=0.3 needs layers estimated
    slower than dense: compile warns, naming the ratio with them kept dense; compiling
    as it says does not warn, nor does prefer="size" or a batch large enough."""
    import warnings  # noqa: PLC0415
    monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)
    x = torch.randn(8, 512)
    with pytest.warns(tncompile.SlowerThanDenseWarning, match="Keeping the 2 slower layers dense") as caught:
        compiled = tncompile.compile(_wide_mlp(), target_ratio=0.3, example_inputs=(x,), batch_sizes=[256],
                                     mode=mode)
    speed = compiled.report().speed
    assert speed.speedup < tuning.SLOWER_WARNING_BELOW and len(speed.slower) == 2
    message = str(caught[0].message)
    assert f"target_ratio={speed.ratio_without_slower:.3g}" in message and "gpu-like (test)" in message
    assert caught[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", tncompile.SlowerThanDenseWarning)
        advised = tncompile.compile(_wide_mlp(), target_ratio=float(f"{speed.ratio_without_slower:.3g}"),
                                    exclude_modules=list(speed.slower), example_inputs=(x,), batch_sizes=[256],
                                    mode=mode)
        assert not advised.report().speed.slower
        tncompile.compile(_wide_mlp(), target_ratio=0.3, example_inputs=(x,), batch_sizes=[256], prefer="size",
                          mode=mode)
        tncompile.compile(_wide_mlp(), target_ratio=0.3, example_inputs=(x,), batch_sizes=[4096], mode=mode)


def test_compile_warns_when_every_compressed_layer_is_slower(monkeypatch):
    monkeypatch.setattr(tuning, "DEVICE_SPEED", GPU_LIKE)
    with pytest.warns(tncompile.SlowerThanDenseWarning, match="Every compressed layer is estimated slower"):
        compiled = tncompile.compile(_mlp(), target_ratio=0.3, example_inputs=(torch.randn(32, 256),))
    assert compiled.report().speed.ratio_without_slower == pytest.approx(1.0)
