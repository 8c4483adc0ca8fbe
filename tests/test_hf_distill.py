"""task=hf_draft_distill: a Hugging Face student distilled from a Hugging Face teacher. Tiny random
GPT-NeoX (teacher) and Llama (student) models over a word-level tokenizer built here, saved with
save_pretrained; end to end through run(cfg), then the export as transformers' assistant_model."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_data import build_tokenizer, write_corpus

from specdec_models.errors import SpecdecError

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

TASK = "hf_draft_distill"


def save_model(path, tok, arch, seed, vocab=None, hidden=32, sharpen=8.0, tied=False, depth=2):
    """A seeded random causal LM of `depth` layers over `tok`'s vocabulary (head padded to `vocab`
    rows if given), saved with the tokenizer as a model directory."""
    torch.manual_seed(seed)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = dict(vocab_size=vocab or len(tok), hidden_size=hidden, num_hidden_layers=depth, num_attention_heads=4,
                  intermediate_size=2 * hidden, max_position_embeddings=128, tie_word_embeddings=tied, **ids)
    if arch == "neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)      # random heads are nearly uniform otherwise
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_pair")
    tok = build_tokenizer(d / "tok")
    other_vocab = build_tokenizer(d / "tok_vocab", extra=("<sep>",))
    other_special = build_tokenizer(d / "tok_special", eos="<bos>")
    corpus = d / "corpus.txt"
    write_corpus(corpus, docs=300)
    return {
        "tok": tok,
        "corpus": corpus,
        "teacher": save_model(d / "teacher", tok, "neox", 0, hidden=64),
        "student": save_model(d / "student", tok, "llama", 1),
        "padded": save_model(d / "padded", tok, "llama", 2, vocab=len(tok) + 8),
        "other_vocab": save_model(d / "other_vocab", other_vocab, "llama", 3),
        "other_special": save_model(d / "other_special", other_special, "llama", 4),
        "big_student": save_model(d / "big_student", tok, "llama", 5, hidden=128),
        "tied": save_model(d / "tied", tok, "llama", 6, vocab=len(tok) + 8, tied=True),   # Llama 3.2 1B, SmolLM2
    }


@pytest.fixture
def hf_cfg(pair, tmp_path):
    from train.run import compose

    def make(*extra, student="student", teacher="teacher"):
        return compose([
            f"experiment={TASK}", f"teacher.path={pair[teacher]}", f"student.path={pair[student]}",
            f"data.files=[{pair['corpus']}]", f"data.windows_dir={tmp_path / 'cache'}",
            f"output_dir={tmp_path / 'run'}", "trainer=cpu", "teacher.dtype=float32", "data.seq_len=32",
            "data.batch_size=4", "data.val_windows=4", "data.val_batch_size=4", "trainer.max_steps=4",
            "trainer.val_check_interval=2",
            "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "optim.lr=3e-3", "optim.warmup_steps=1", "objective.prompt_len=8",
            "objective.gen_len=8", "callbacks.speculative_eval.num_prompts=2",
            "callbacks.speculative_eval.prompt_len=8", "callbacks.speculative_eval.max_new_tokens=8",
            "callbacks.progress_bar=null", *extra])
    return make


def build_module(cfg):
    from train.run import validate
    from train.tasks.hf_draft_distill import HFDraftDistillModule

    module = HFDraftDistillModule(**validate(cfg))
    module.setup("fit")
    return module


def greedy(model, ids, n, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def test_distillation_end_to_end_and_the_export_is_a_transformers_assistant(hf_cfg, pair):
    from train.run import run

    cfg = hf_cfg("objective.data=student", "objective.divergence=jsd")
    result = run(cfg)
    assert result["global_step"] == 4
    out = result["output_dir"]
    # the checkpoint holds the student alone
    ckpt = torch.load(result["last_ckpt"], map_location="cpu", weights_only=True)
    assert ckpt["specdec_task"] == TASK and ckpt["state_dict"]
    assert all(k.startswith("student.") for k in ckpt["state_dict"])
    # the evaluation callback decoded with the teacher as target and the student as draft
    rows = [json.loads(line) for line in (out / "speculative_samples.jsonl").read_text().splitlines()]
    assert rows and all(r["matches_base"] for r in rows if r["temperature"] == 0)
    assert "val/acceptance_rate/t0" in result["metrics"]
    # the export: a save_pretrained directory with the tokenizer, nothing temporary left beside it
    export = result["export_dir"]
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert not [p for p in export.parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    meta = json.loads((export / "specdec_distill.json").read_text())
    assert meta["global_step"] == 4 and meta["objective"]["divergence"] == "jsd"
    student = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    # the gamma the last evaluation found best (batch 1, the config's temperature) is the
    # assistant's num_assistant_tokens, kept constant
    from specdec_models.decode.cost import stored_profile

    config = student.generation_config
    assert {(p["temperature"], p["batch"]) for p in meta["speed_profiles"]} == {(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)}
    chosen = stored_profile(meta, 1.0 if config.do_sample else 0.0, 1).best_gamma()
    assert config.num_assistant_tokens == chosen and config.num_assistant_tokens_schedule == "constant"
    tok = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert tok.get_vocab() == pair["tok"].get_vocab()
    initial = transformers.AutoModelForCausalLM.from_pretrained(pair["student"], local_files_only=True)
    assert not torch.equal(student.lm_head.weight, initial.lm_head.weight)            # it trained
    saved = {k: v for k, v in ckpt["state_dict"].items()}
    torch.testing.assert_close(student.lm_head.weight, saved["student.lm_head.weight"])
    teacher = transformers.AutoModelForCausalLM.from_pretrained(pair["teacher"], local_files_only=True).eval()
    ids = torch.tensor([tok("the quick brown fox jumps")["input_ids"]])
    plain = greedy(teacher, ids, 12)
    assisted = greedy(teacher, ids, 12, assistant_model=student)
    assert assisted == plain and len(plain) > 0


def test_gradients_never_reach_the_teacher_and_it_is_absent_from_the_state(hf_cfg):
    module = build_module(hf_cfg("objective.data=teacher"))
    teacher = module.teacher
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert all(name.startswith("student.") for name in module.state_dict())
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.student.parameters()}
    seq = torch.randint(0, module.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    loss, *_ = module._loss(seq)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in module.student.parameters() if p.requires_grad)
    # rows sampled from the teacher are prompt + gen_len tokens
    rows = module.sample_rows(seq[:2, :8], "teacher", torch.Generator().manual_seed(1))
    assert rows.shape == (2, 16) and torch.equal(rows[:, :8], seq[:2, :8])


def test_a_changed_teacher_is_refused_when_a_run_resumes(hf_cfg, pair, tmp_path):
    import shutil

    from train.run import validate
    from train.tasks.hf_draft_distill import HFDraftDistillModule

    teacher = tmp_path / "teacher"
    shutil.copytree(pair["teacher"], teacher)
    kwargs = validate(hf_cfg(f"teacher.path={teacher}"))
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(SpecdecError, match="has changed since this run started"):
        HFDraftDistillModule(**kwargs).setup("fit")


def test_a_padded_student_head_is_sliced_to_the_shared_vocabulary(hf_cfg, pair):
    from specdec_models.decode import GREEDY, DraftModel, generate

    module = build_module(hf_cfg(student="padded"))
    V = len(pair["tok"])
    assert module.vocab_size == V and module.student.get_output_embeddings().weight.shape[0] == V + 8
    seq = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, _, _, logits, teacher = module._loss(seq)
    assert logits.shape[-1] == teacher.shape[-1] == V and torch.isfinite(loss)
    models = module.speculative_models()
    prompts = seq[:, :5]
    alone, _ = generate(models.target, prompts, 10, sampling=GREEDY)
    spec, _ = generate(models.target, prompts, 10, DraftModel(models.draft), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in spec] == [t.tolist() for t in alone]
    assert models.target.device == torch.device("cpu")                       # what SpeculativeEval reads


def test_a_tied_student_exports_in_export_dtype_with_its_heads_tied(hf_cfg, tmp_path):
    module = build_module(hf_cfg("student.export_dtype=bfloat16", student="tied"))
    with torch.no_grad():
        module.student.get_input_embeddings().weight.add_(0.5)         # as if trained
    out = module.write_export(tmp_path / "export", {"global_step": 7})
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["use_cache"] is True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.dtype == torch.bfloat16
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert torch.equal(loaded.get_input_embeddings().weight, module.student.get_input_embeddings().weight.bfloat16())
    assert module.student.dtype == torch.float32 and module.student.config.use_cache is False     # left as it was
    again = module.write_export(out, {"global_step": 8})                  # replaces the previous export
    assert json.loads((again / "specdec_distill.json").read_text())["global_step"] == 8
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["export"]


@pytest.mark.parametrize("student, message", [
    ("other_vocab", r"tokenizers differ in size: \d+ tokens \(teacher .*\), \d+ \(student"),
    ("other_special", "special tokens differ \\(eos_token"),
])
def test_a_student_with_another_tokenizer_stops_the_run_before_training(hf_cfg, student, message, tmp_path):
    from train.run import run

    with pytest.raises(SpecdecError, match=message) as err:
        run(hf_cfg(student=student))
    assert "\n" not in str(err.value) and "must share one tokenizer" in str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("student.path=null", "needs student.path"),
    ("teacher.dtype=float64", "teacher.dtype must be one of"),
    ("objective.divergence=kld", "objective.divergence"),
    ("data.seq_len=200", "exceeds the teacher's 128 positions"),
    ("student.export_dtype=int8", "student.export_dtype"),
])
def test_bad_configs_give_a_one_line_error(hf_cfg, override, message):
    from train.run import validate

    with pytest.raises(SpecdecError, match=message) as err:
        validate(hf_cfg(override))
    assert "\n" not in str(err.value)


def test_a_student_as_large_as_the_teacher_warns(hf_cfg):
    from train.run import validate

    with pytest.warns(UserWarning, match="not smaller than the teacher"):
        validate(hf_cfg(student="big_student"))


@pytest.mark.parametrize("experiment", ["hf_draft_distill"])
def test_every_hf_experiment_composes_and_validates(compose, pair, experiment):
    from conftest import CONF

    from train.run import validate

    cfg = compose([f"experiment={experiment}"])
    assert cfg.task.name == TASK and cfg.teacher.path is None and cfg.student.path is None
    assert cfg.data.chat is False                   # plain text: a chat preset sets data.chat=true
    with pytest.raises(SpecdecError, match="needs teacher.path"):
        validate(cfg)
    cfg = compose([f"experiment={experiment}", f"teacher.path={pair['teacher']}", f"student.path={pair['student']}",
                   "data.seq_len=64"])
    kwargs = validate(cfg)
    assert kwargs["metadata"]["name"] == experiment and kwargs["vocab_size"] == len(pair["tok"])
    first = (CONF / "experiment" / f"{experiment}.yaml").read_text().splitlines()
    assert first[0] == "# @package _global_" and first[1].startswith("# Run: python -m train experiment=")
