"""A compressed model's ``save_pretrained`` folder is an ordinary Hugging Face folder:
``model.safetensors`` under the model's own names and a ``quantization_config`` of data in
``config.json``. transformers' ``from_pretrained`` (through tncompile's ``HfQuantizer``),
pipelines and sentence-transformers load it as the compressed model, exactly; tampered
folders are refused before any weight is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import tncompile
from tncompile import ModelFileError
from tncompile.runtime import TTLinear, TTMEmbedding, TTMTiedLinear

transformers = pytest.importorskip("transformers")


def _bert(vocab=120):
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _perturbed(model):
    with torch.no_grad():  # weights no fresh compile would have
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    ids = torch.randint(0, 120, (4, 16))
    c = _perturbed(tncompile.compile(_bert(), target_ratio=0.3, example_inputs={"input_ids": ids}, mode="swap"))
    folder = tmp_path_factory.mktemp("hf") / "bert"
    c.save_pretrained(folder)
    return folder, c.eval()


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_from_pretrained_loads_the_compressed_model_exactly(bert_folder):
    folder, c = bert_folder
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "tncompile" and len(config["layers"]) == len(c.tensorized_modules())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the model's own names
        names = set(f.keys())
    assert "bert.encoder.layer.0.attention.self.query.cores.0" in names
    assert names - {"tncompile/example.0"} == set(c.state_dict())
    ids = torch.randint(0, 120, (3, 16))
    for cls in (transformers.BertForSequenceClassification, transformers.AutoModelForSequenceClassification):
        loaded, info = cls.from_pretrained(folder, output_loading_info=True)
        assert type(loaded).__name__ == "BertForSequenceClassification" and not loaded.training
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert isinstance(loaded.bert.encoder.layer[0].attention.self.query, TTLinear)
        assert isinstance(loaded.bert.embeddings.word_embeddings, TTMEmbedding)
        assert loaded.ratio == pytest.approx(c.ratio) and "query" in str(loaded.report())
        torch.testing.assert_close(_logits(loaded, ids), _logits(c, ids), rtol=0, atol=0)
    via_load = tncompile.load(folder, model=transformers.BertForSequenceClassification)
    torch.testing.assert_close(_logits(via_load, ids), _logits(c, ids), rtol=0, atol=0)


def test_a_from_pretrained_model_trains_cuts_and_saves_like_a_compiled_one(bert_folder, tmp_path):
    """Derived state follows: an AdamW step and a rank cut on the from_pretrained model give
    what they give on the tncompile.load one; its save_pretrained folder loads back exactly."""
    folder, _ = bert_folder
    ids, labels = torch.randint(0, 120, (8, 16)), torch.randint(0, 3, (8,))
    models = [transformers.BertForSequenceClassification.from_pretrained(folder),
              tncompile.load(folder, model=transformers.BertForSequenceClassification)]
    for m in models:
        m.train()
        opt = torch.optim.AdamW(tncompile.param_groups(m, lr=1e-2))
        ctl = tncompile.RankController(m, opt, target_ratio=0.2, truncate_every=1)
        torch.manual_seed(1)
        F.cross_entropy(m(input_ids=ids).logits, labels).backward()
        opt.step()
        ctl.truncate()
    a, b = models
    assert a.ratio == pytest.approx(b.ratio) and a.ratio < 0.3
    torch.testing.assert_close(_logits(a, ids), _logits(b, ids), rtol=0, atol=0)
    a.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "again")
    torch.testing.assert_close(_logits(again, ids), _logits(a, ids), rtol=0, atol=0)


def test_gpt2_tied_head_generates_the_same_tokens_and_loads_in_bf16(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (2, 8))
    c = tncompile.compile(transformers.GPT2LMHeadModel(cfg), target_ratio=0.4,
                          example_inputs={"input_ids": ids, "use_cache": False}, mode="swap").eval()
    c.save_pretrained(tmp_path / "gpt2")
    assert (tmp_path / "gpt2" / "generation_config.json").is_file()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert isinstance(loaded.lm_head, TTMTiedLinear) and loaded.lm_head.embedding is loaded.transformer.wte

    def greedy(m):
        with torch.no_grad():
            return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(greedy(loaded), greedy(c))
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        torch.testing.assert_close(half(ids).logits.float(), c(ids).logits, rtol=0.05, atol=0.05)


def _tokenizer(folder: Path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(115)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(words))
    return transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def test_a_pipeline_built_from_the_folder_runs_the_compressed_model(bert_folder, tmp_path):
    folder, c = bert_folder
    copy = tmp_path / "with_tokenizer"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    tok = _tokenizer(tmp_path / "vocab")
    tok.save_pretrained(copy)
    classify = transformers.pipeline("text-classification", model=str(copy), top_k=None)
    assert isinstance(classify.model.bert.encoder.layer[1].output.dense, TTLinear)
    scores = {r["label"]: r["score"] for r in classify(["w1 w2 w3"])[0]}
    enc = tok("w1 w2 w3", return_tensors="pt")
    with torch.no_grad():
        want = c(**enc).logits.softmax(-1)[0]
    assert scores == pytest.approx({f"LABEL_{i}": float(want[i]) for i in range(3)}, abs=1e-6)


def test_sentence_transformers_loads_a_saved_compressed_model(tmp_path):
    st_lib = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    tok = _tokenizer(tmp_path / "vocab")
    transformers.BertModel(cfg).save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    st = st_lib.SentenceTransformer(modules=[models.Transformer(str(tmp_path / "dense")),
                                             models.Pooling(64)], device="cpu")
    enc = tok(["w1 w2 w3", "w4 w5"], padding="max_length", max_length=16, return_tensors="pt")
    st[0].model = _perturbed(tncompile.compile(st[0].model, target_ratio=0.3, mode="swap",
                                               example_inputs={"input_ids": enc["input_ids"],
                                                               "attention_mask": enc["attention_mask"]}))
    st.eval()
    sentences = ["w1 w2 w3 w7", "w4 w5", "w9"]
    want = st.encode(sentences, convert_to_tensor=True)
    st.save(str(tmp_path / "st"))
    loaded = st_lib.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert isinstance(loaded[0].model.encoder.layer[0].attention.self.query, TTLinear)
    torch.testing.assert_close(loaded.encode(sentences, convert_to_tensor=True), want, rtol=0, atol=0)


# ----------------------------------------------------------------- tampered folders
def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(folder: Path, edit) -> None:
    data = json.loads((folder / "config.json").read_text())
    edit(data)
    (folder / "config.json").write_text(json.dumps(data))


def test_from_pretrained_refuses_a_table_that_disagrees_with_the_weights(bert_folder, tmp_path):
    folder, _ = bert_folder
    edited = _copy(folder, tmp_path / "rank")

    def grow_a_rank(data):
        row = data["quantization_config"]["layers"][1]
        row["layout"]["ranks"][0] += 1
    _edit_config(edited, grow_a_rank)
    with pytest.raises(ModelFileError, match="ranks\\[0\\]: 5 is not an int"):  # checked before it is hashed
        transformers.BertForSequenceClassification.from_pretrained(edited)


def test_from_pretrained_refuses_weights_of_another_save(bert_folder, tmp_path):
    folder, _ = bert_folder
    ids = torch.randint(0, 120, (4, 16))
    other = tncompile.compile(_bert(), target_ratio=0.5, example_inputs={"input_ids": ids}, mode="swap")
    other.save_pretrained(tmp_path / "other")
    mixed = _copy(folder, tmp_path / "mixed")
    (mixed / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    for load in (lambda: transformers.AutoModelForSequenceClassification.from_pretrained(mixed),
                 lambda: tncompile.load(mixed, model=transformers.BertForSequenceClassification)):
        with pytest.raises(ModelFileError, match="do not belong together|its layout makes it"):
            load()


def test_from_pretrained_refuses_an_inflated_config_before_allocating(bert_folder, tmp_path):
    """vocab_size=2**27 (a 32 GB dense table) in config.json, the table and weights untouched:
    refused on the meta device, under a 3 GB address-space limit."""
    folder, _ = bert_folder
    edited = _copy(folder, tmp_path / "inflated")
    _edit_config(edited, lambda data: data.update(vocab_size=2**27))
    script = textwrap.dedent(f"""
        import resource, sys
        import tncompile, transformers
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        try:
            transformers.BertForSequenceClassification.from_pretrained({str(edited)!r})
        except tncompile.ModelFileError as e:
            print("refused:", e)
            sys.exit(0)
        sys.exit(1)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "refused:" in run.stdout, run.stdout[-1000:] + run.stderr[-2000:]


def test_a_folder_of_the_first_format_says_how_to_load_it(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "tncompile-model.tnc").write_bytes(b"x")
    (old / "config.json").write_text(json.dumps({"model_type": "bert", "tncompile": {"file": "tncompile-model.tnc"}}))
    with pytest.raises(ModelFileError, match="tncompile-model.tnc"):
        tncompile.load(old, model=transformers.BertForSequenceClassification)


@pytest.mark.parametrize("first", ["tncompile", "transformers"])
def test_import_tncompile_registers_the_backend_without_importing_transformers(bert_folder, first):
    """``import tncompile`` costs no transformers import; the backend is registered right after
    transformers imports its quantizer registry -- or at once when it already has."""
    folder, _ = bert_folder
    imports = ("import tncompile, sys; assert 'transformers' not in sys.modules; import transformers"
               if first == "tncompile" else "import transformers.quantizers.auto, transformers, tncompile")
    script = f"""{imports}
m = transformers.AutoModelForSequenceClassification.from_pretrained({str(folder)!r})
print(type(m.bert.encoder.layer[0].attention.self.query).__name__)"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "TTLinear", run.stderr[-2000:]


def test_from_pretrained_compresses_a_dense_folder_when_asked(tmp_path):
    """``from_pretrained(dense, quantization_config=TNCompileConfig(target_ratio=...))`` is
    ``tncompile.compile(loaded, ..., mode="swap")`` on the class's dummy inputs; its
    ``save_pretrained`` folder loads back exactly; bad settings are refused."""
    from tncompile.integrations.hf_quantizer import TNCompileConfig
    _bert().save_pretrained(tmp_path / "dense")
    cls = transformers.BertForSequenceClassification
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "dense", quantization_config=TNCompileConfig(target_ratio=0.3))
    assert isinstance(loaded.bert.encoder.layer[0].attention.self.query, TTLinear) and loaded.ratio <= 0.3 + 1e-9
    dense = cls.from_pretrained(tmp_path / "dense")
    yourself = tncompile.compile(dense, target_ratio=0.3, example_inputs=dict(dense.dummy_inputs), mode="swap")
    ids = torch.randint(0, 120, (3, 12))
    torch.testing.assert_close(_logits(loaded, ids), _logits(yourself, ids), rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "compressed")
    assert json.loads((tmp_path / "compressed" / "config.json").read_text())["quantization_config"]["layers"]
    again = cls.from_pretrained(tmp_path / "compressed")
    torch.testing.assert_close(_logits(again, ids), _logits(loaded, ids), rtol=0, atol=0)
    for bad in ({}, {"target_ratio": 0.3, "attn_implementation": "x"}):
        with pytest.raises(ValueError, match="target_ratio"):
            TNCompileConfig(**bad)


# ----------------------------------------------------------------- issue 53: hostile folders
def _reseal_folder(folder: Path, dst: Path, edit) -> Path:
    """``folder`` copied to ``dst`` with ``edit(manifest, tensors)`` applied to its
    quantization_config and weights, and the checksum recomputed (as an attacker can)."""
    from safetensors.torch import load_file, save_file
    from tncompile.integrations.hf_folder import canonical
    from tncompile.serialization.container import digest
    _copy(folder, dst)
    data = json.loads((dst / "config.json").read_text())
    manifest = dict(data["quantization_config"])
    manifest.pop("quant_method")
    tensors = load_file(dst / "model.safetensors")
    edit(manifest, tensors)
    data["quantization_config"] = {"quant_method": "tncompile", **manifest}
    (dst / "config.json").write_text(json.dumps(data))
    save_file(tensors, dst / "model.safetensors",
              metadata={"format": "pt", "tncompile_sha256": digest(tensors, canonical(manifest))})
    return dst


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    c = tncompile.compile(transformers.GPT2LMHeadModel(cfg), target_ratio=0.4,
                          example_inputs={"input_ids": torch.randint(1, 300, (2, 8)), "use_cache": False},
                          mode="swap")
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    c.save_pretrained(folder)
    return folder


def _untie_dense(manifest, tensors):
    manifest["layers"] = [r for r in manifest["layers"] if r["path"] != "lm_head"]


def _untie_network(manifest, tensors):
    from tncompile.formats.layout import TTLayout
    layout = TTLayout.for_shape(64, 300, 3).with_ranks(2)
    row = next(r for r in manifest["layers"] if r["path"] == "lm_head")
    row.update(kind="linear", tied_to=None, layout={
        "format": "TT", "in_features": 64, "out_features": 300, "in_modes": list(layout.in_modes),
        "out_modes": list(layout.out_modes), "ranks": list(layout.ranks), "experts": 1},
        cores=[f"lm_head.cores.{k}" for k in range(layout.num_cores)],
        gates=[f"lm_head.gates.{k}" for k in range(layout.num_cores - 1)])
    tensors.update({f"lm_head.cores.{k}": torch.randn(s) for k, s in enumerate(layout.core_shapes())})
    tensors.update({f"lm_head.gates.{k}": torch.ones(r) for k, r in enumerate(layout.ranks)})
    manifest["state"]["names"] += row["cores"] + row["gates"]


@pytest.mark.parametrize("untie", [_untie_dense, _untie_network], ids=["dense-head", "own-network"])
def test_a_folder_cannot_untie_a_head_from_its_embedding(gpt2_folder, tmp_path, untie):
    edited = _reseal_folder(gpt2_folder, tmp_path / "untied", untie)
    for load in (lambda: transformers.GPT2LMHeadModel.from_pretrained(edited),
                 lambda: tncompile.load(edited, model=transformers.GPT2LMHeadModel)):
        with pytest.raises(ModelFileError, match="ties .*lm_head.* to one weight"):
            load()


def test_a_config_asking_for_300_layers_is_refused_before_tracing_them(bert_folder, tmp_path):
    """num_hidden_layers=300 while the weights were saved with 2: refused before any layer is
    traced, in a few seconds, by both loaders -- tncompile.load before anything is built (the
    config fields recorded beside the weights, issue 65 item 8), from_pretrained once
    transformers has built the model on meta."""
    folder, _ = bert_folder
    edited = _copy(folder, tmp_path / "deep")
    _edit_config(edited, lambda data: data.update(num_hidden_layers=300))
    for load in (lambda: transformers.BertForSequenceClassification.from_pretrained(edited),
                 lambda: tncompile.load(edited, model=transformers.BertForSequenceClassification)):
        start = time.time()
        with pytest.raises(ModelFileError, match="num_hidden_layers=300 in config.json, 2 in the model saved"):
            load()
        assert time.time() - start < 15


@pytest.mark.parametrize("damage", ["config-is-a-directory", "config-nested-deep", "weights-are-proc-mem",
                                    "weights-are-a-fifo", "not-a-manifest"])
def test_every_damaged_folder_is_a_model_file_error(bert_folder, tmp_path, damage):
    folder, _ = bert_folder
    edited = _copy(folder, tmp_path / "damaged")
    if damage == "config-is-a-directory":
        (edited / "config.json").unlink()
        (edited / "config.json").mkdir()
    elif damage == "config-nested-deep":
        (edited / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "weights-are-proc-mem":
        (edited / "model.safetensors").unlink()
        (edited / "model.safetensors").symlink_to("/proc/self/mem")
    elif damage == "weights-are-a-fifo":
        (edited / "model.safetensors").unlink()
        os.mkfifo(edited / "model.safetensors")
    else:
        _edit_config(edited, lambda data: data.update(quantization_config={"quant_method": "tncompile", "x": 1}))
    with pytest.raises(ModelFileError):
        tncompile.load(edited, model=transformers.BertForSequenceClassification)
    if damage in ("not-a-manifest", "config-nested-deep"):  # (transformers reads a weights file's header itself
        with pytest.raises(ModelFileError):                  # before any backend; a config through tncompile's hook)
            transformers.BertForSequenceClassification.from_pretrained(edited)


def test_a_dense_folder_given_to_load_says_it_is_dense(tmp_path):
    _bert().save_pretrained(tmp_path / "dense")
    with pytest.raises(ModelFileError, match="holds a dense model"):
        tncompile.load(tmp_path / "dense", model=transformers.BertForSequenceClassification)


def test_loading_a_folder_leaves_the_callers_random_streams(gpt2_folder):
    """GPT-2's class initializes its weights at random: building it from the folder's config
    happens inside the loader's fork of the random streams."""
    import random
    for load in (lambda: tncompile.load(gpt2_folder, model=transformers.GPT2LMHeadModel),
                 lambda: transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder)):
        torch.manual_seed(1)
        before, py = torch.get_rng_state().clone(), random.getstate()
        load()
        assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py


@pytest.mark.parametrize("field,value,says", [
    ("target_modules", "(.|.)*Q", "regular expression"),
    ("target_modules", ["query", "(a+)+$"], "regular expression"),
    ("exclude_modules", ".*", "regular expression"),
    ("r", 20_000_000, "r must be an int in"),
    ("rank_pattern", {"query": 10**9}, "rank_pattern"),
])
def test_an_adapter_config_is_bounded_before_peft_sees_it(field, value, says):
    """The adapter folder's config goes through tt_lora: a catastrophic regex would hang PEFT's
    matching, a rank of 2e7 would allocate 4.8 GiB before the 4 KB adapter file is read."""
    peft = pytest.importorskip("peft")
    from tncompile.integrations.peft_lora import tt_lora
    config = peft.LoraConfig(target_modules=["query"], r=4)
    setattr(config, field, value)
    with pytest.raises(ModelFileError, match=says):
        tt_lora(config)


def test_an_adapter_rank_above_the_layers_side_is_refused_before_allocating(bert_folder):
    peft = pytest.importorskip("peft")
    from tncompile.integrations.peft_lora import tt_lora
    base = transformers.BertForSequenceClassification.from_pretrained(bert_folder[0])
    with pytest.raises(ModelFileError, match="LoRA rank"):
        peft.get_peft_model(base, tt_lora(peft.LoraConfig(target_modules=["query"], r=65)))  # sides are 64


def test_a_compressed_folder_refuses_to_load_without_tncompile(bert_folder):
    """Issue 52: transformers alone would build the class and leave every compressed layer at
    random init (one log line). The folder's config refuses to build without tncompile, naming
    it and the install command; with tncompile imported it loads (the tests above)."""
    folder, _ = bert_folder
    assert json.loads((folder / "config.json").read_text())["dtype"].startswith("compressed by tncompile")
    script = textwrap.dedent(f"""
        import sys, transformers
        for load in (transformers.AutoModel.from_pretrained, transformers.BertForSequenceClassification.from_pretrained,
                     transformers.AutoConfig.from_pretrained):
            try:
                load({str(folder)!r})
            except Exception as e:
                print(type(e).__name__, e)
                continue
            print("LOADED")
        assert "tncompile" not in sys.modules
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 3 and all("pip install tncompile, then import tncompile" in line for line in lines), lines


def test_a_folder_loaded_onto_another_class_names_the_saved_one(bert_folder):
    folder, _ = bert_folder
    with pytest.raises(ModelFileError, match="saved from a compressed BertForSequenceClassification.*GPT2Model"):
        tncompile.load(folder, model=transformers.GPT2Model)


def test_a_class_given_for_a_model_file_says_to_pass_an_instance(tmp_path):
    from tncompile.testing import SixEncoder, small_encoder
    compiled = tncompile.compile(small_encoder(max_len=16), target_ratio=0.3)
    tncompile.save(compiled, tmp_path / "m.tnc")
    with pytest.raises(TypeError, match="model is a class; pass an instance"):
        tncompile.load(tmp_path / "m.tnc", model=SixEncoder)


def test_reloading_adapters_without_drawing_from_the_random_stream(bert_folder, tmp_path):
    """The adapter load path: PEFT initializes adapters at random before loading them (for every
    model); with low_cpu_mem_usage=True it builds them empty, so the reload leaves the caller's
    stream as it was -- and loads the same adapters."""
    peft = pytest.importorskip("peft")
    from tncompile.integrations.peft_lora import tt_lora
    base = transformers.BertForSequenceClassification.from_pretrained(bert_folder[0])
    lora = peft.get_peft_model(base, tt_lora(peft.LoraConfig(target_modules=["query", "value"], r=4,
                                                             init_lora_weights=False)))
    lora.save_pretrained(tmp_path / "adapters")
    again = transformers.BertForSequenceClassification.from_pretrained(bert_folder[0])
    torch.manual_seed(3)
    before = torch.get_rng_state().clone()
    reloaded = peft.PeftModel.from_pretrained(
        again, tmp_path / "adapters", config=tt_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapters")),
        low_cpu_mem_usage=True)
    assert torch.equal(torch.get_rng_state(), before)
    ids = torch.randint(0, 120, (2, 16))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(lora, ids), rtol=0, atol=0)


def test_config_json_is_bound_to_the_weights_beside_it(bert_folder, tmp_path):
    """Issue 65 item 8: num_hidden_layers=20000 used to build every layer on meta before the
    parameter count refused it (28 s, +1.27 GB). The fields that decide the structure are
    recorded beside the weights, under the checksum, and a config that disagrees is refused
    before anything is built; edits of other fields still load."""
    folder, _ = bert_folder
    edited = _copy(folder, tmp_path / "huge")
    _edit_config(edited, lambda data: data.update(num_hidden_layers=20000))
    start = time.time()
    with pytest.raises(ModelFileError, match="num_hidden_layers=20000 in config.json"):
        tncompile.load(edited, model=transformers.BertForSequenceClassification)
    assert time.time() - start < 5
    benign = _copy(folder, tmp_path / "benign")
    _edit_config(benign, lambda data: data.update(use_cache=False, a_newer_transformers_field=7,
                                                  pad_token_id=3))
    tncompile.load(benign, model=transformers.BertForSequenceClassification)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        recorded = json.loads(f.metadata()["tncompile_structure"])
    assert recorded["num_hidden_layers"] == 2 and "pad_token_id" not in recorded
