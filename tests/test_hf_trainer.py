"""transformers.Trainer trains a compressed (swap-mode) model: rank control as a callback
(stages, cuts inside Trainer's optimizer, cuts in the logs), save_model that reloads exactly,
and resuming from a checkpoint taken after cuts (tncompile.integrations.hf)."""
import pytest
import torch

import tncompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from tncompile.integrations.hf import CompressedTrainer, RankControlCallback  # noqa: E402


def _bert():
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _data(n=192, seed=0):
    """A learnable task: the label is the first token's id mod 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (n, 16), generator=g)
    return [{"input_ids": x, "labels": int(x[0]) % 3} for x in ids]


def _args(out, **kw):
    return transformers.TrainingArguments(output_dir=str(out), max_steps=24, per_device_train_batch_size=8,
                                          learning_rate=2e-3, logging_steps=4, save_steps=12, report_to=[],
                                          use_cpu=True, seed=0, disable_tqdm=True, **kw)


def _compressed():
    ids = torch.randint(0, 300, (4, 16))
    return tncompile.compile(_bert(), 0.4, example_inputs={"input_ids": ids}, mode="swap")


def test_trainer_trains_cuts_saves_and_resumes_a_compressed_model(tmp_path):
    model = _compressed()
    start = model.ratio
    callback = RankControlCallback(target_ratio=0.3, early_fraction=0.25, truncate_every=4)
    trainer = CompressedTrainer(model=model, args=_args(tmp_path / "run"), train_dataset=_data(),
                                callbacks=[callback])
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < losses[0]
    cuts = [h for h in history if h.get("tncompile_event") == "cut"]
    assert cuts and any(h.get("tncompile_event") == "late_stage" for h in history)
    assert model.ratio <= 0.3 + 1e-9 < start
    assert callback.controller.steps_done == 24 and callback.controller.stage == "late"
    # Trainer's optimizer holds the cut parameters (and their sliced state), not the old ones
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} <= held
    # save_model reloads exactly, at the cut ranks, through tncompile.load and from_pretrained
    trainer.save_model(str(tmp_path / "final"))
    model.eval()
    ids = torch.randint(0, 300, (4, 16))
    for loaded in (tncompile.load(tmp_path / "final", model=transformers.BertForSequenceClassification).eval(),
                   transformers.BertForSequenceClassification.from_pretrained(tmp_path / "final")):
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)

    # resume from the checkpoint at step 12 (after cuts) with a fresh model at the compiled ranks
    checkpoint = tmp_path / "run" / "checkpoint-12"
    resumed_callback = RankControlCallback(target_ratio=0.3, early_fraction=0.25, truncate_every=4)
    fresh = _compressed()
    resumed = CompressedTrainer(model=fresh, args=_args(tmp_path / "run"), train_dataset=_data(),
                                callbacks=[resumed_callback])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.model is not fresh and isinstance(resumed.model, transformers.BertForSequenceClassification)
    assert resumed_callback.controller.steps_done == 24 and resumed_callback.controller.stage == "late"
    assert resumed.model.ratio <= 0.3 + 1e-9
    assert [h["step"] for h in resumed_callback.events] == [h["step"] for h in callback.events if h["step"] > 12]


def test_load_best_model_at_end_loads_the_best_compressed_checkpoint(tmp_path):
    """The best checkpoint (the first of two, by a metric made to fall) becomes
    ``trainer.model``, cut ranks and all; plain Trainer would keep the last model."""
    evaluations = []

    def falling(_):
        evaluations.append(1)
        return {"marker": -float(len(evaluations))}  # greater is better: the first evaluation wins

    model = _compressed()
    callback = RankControlCallback(target_ratio=0.3, early_fraction=0.25, truncate_every=4)
    trainer = CompressedTrainer(model=model, args=_args(tmp_path / "run", eval_strategy="steps", eval_steps=12,
                                                        load_best_model_at_end=True, metric_for_best_model="marker",
                                                        greater_is_better=True),
                                train_dataset=_data(), eval_dataset=_data(16, seed=1), compute_metrics=falling,
                                callbacks=[callback])
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-12") and len(evaluations) == 2
    best = tncompile.load(tmp_path / "run" / "checkpoint-12", model=transformers.BertForSequenceClassification)
    assert trainer.model is not model
    got = dict(trainer.model.named_parameters())
    assert got.keys() == dict(best.named_parameters()).keys()
    assert all(torch.equal(p, got[n]) for n, p in best.named_parameters())
    assert any(not torch.equal(p, got[n]) for n, p in model.named_parameters() if n in got)  # not the last model


def test_rank_control_callback_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="early_fraction"):
        RankControlCallback(target_ratio=0.3, early_fraction=1.0)
    dense = _bert()
    trainer = transformers.Trainer(model=dense, args=_args(tmp_path / "dense"), train_dataset=_data(16),
                                   callbacks=[RankControlCallback(target_ratio=0.3)])
    with pytest.raises(TypeError, match="not a compressed model.*swap mode"):
        trainer.train()


def test_plain_trainer_resumes_from_a_checkpoint_taken_after_cuts(tmp_path):
    """Plain ``Trainer(...).train(resume_from_checkpoint=...)`` on a fresh compressed model: the
    checkpoint's state_dict holds cut ranks; the model adopts them (``load_state_dict``), then
    Trainer builds its optimizer and loads its state, and the callback resumes its schedule.
    It said "Can't find a valid checkpoint" (no model.safetensors) before."""
    model = _compressed()
    callback = RankControlCallback(target_ratio=0.3, early_fraction=0.25, truncate_every=4)
    transformers.Trainer(model=model, args=_args(tmp_path / "run"), train_dataset=_data(),
                         callbacks=[callback]).train()
    checkpoint = tmp_path / "run" / "checkpoint-12"
    at_12 = transformers.BertForSequenceClassification.from_pretrained(checkpoint)
    assert at_12.ratio < _compressed().ratio  # cut before the checkpoint

    fresh = _compressed()
    resumed_callback = RankControlCallback(target_ratio=0.3, early_fraction=0.25, truncate_every=4)
    resumed = transformers.Trainer(model=fresh, args=_args(tmp_path / "run"), train_dataset=_data(),
                                   callbacks=[resumed_callback])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.model is fresh and resumed_callback.controller.steps_done == 24
    assert [h["step"] for h in resumed_callback.events] == [h["step"] for h in callback.events if h["step"] > 12]
    assert fresh.ratio == pytest.approx(model.ratio)
    held = {id(p) for group in resumed.optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in fresh.parameters()} <= held
