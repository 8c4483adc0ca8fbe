"""task=hf_eagle3: an EAGLE-3 head trained against a frozen Hugging Face target, end to end through
run(cfg) on a tiny random Llama over a word-level tokenizer (the fixtures of test_hf_prophet_task):
training with hidden states online and from a multi-layer cache, the evaluation callback, the
export and decoding with the exported head, the draft vocabulary from token counts, the
learning-rate schedule under a time budget, and every bad input in one line before any work."""

# ruff: noqa: E402, F811  (the imports follow pytest.importorskip; pytest fixtures imported from sibling
# test modules are named again as test arguments)
from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_prophet_task import SEQ, hf  # noqa: F401  (the tiny targets, tokenizer and corpus)
from test_hf_prophet_task import cfg as prophet_cfg

import train.run as train_run
from specdec_models.errors import SpecdecError
from specdec_models.hf.weights import load_causal_lm, load_tokenizer, tokenizer_fingerprint, vocabulary_fingerprint
from train.data.hf_embeddings import label_mask
from train.tasks.hf_eagle3 import COUNTS_FORMAT

run = train_run.run


HEAD = ("head.draft_vocab_size=null", "head.aux_layers=[0,1,2]", "task.ttt_steps=3")


def cfg(hf, out, *extra, target="llama"):
    """experiment=hf_eagle3 at test sizes (test_hf_prophet_task's), the whole vocabulary, 3 unrolled steps."""
    return prophet_cfg(hf, out, *extra, target=target, experiment="hf_eagle3", head=HEAD)


def counts_file(path, tokenizer, counts):
    path.write_text(json.dumps({"format": COUNTS_FORMAT, "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
                                "counts": counts}))
    return path


@pytest.fixture(scope="module")
def online(hf, tmp_path_factory):
    return run(cfg(hf, tmp_path_factory.mktemp("eagle3") / "run", "callbacks.speculative_eval.tree='2,2,1'"))


def test_online_run_trains_evaluates_and_logs_simulated_acceptance(online):
    assert online["global_step"] == 6
    state = torch.load(online["last_ckpt"], weights_only=True)["state_dict"]
    assert state and all(k.startswith("head.") for k in state)
    assert "head.fc.weight" in state and not any("embed" in k for k in state)      # the target's embedding stays out
    m = online["metrics"]
    for key in ("train/loss", "val/loss", "val/ttt_kl/step0", "val/ttt_accuracy/pos3", "val/simulated_tokens_per_call",
                "val/tokens_per_call/t0", "val/tokens_per_call/t1", "val/per_position_acceptance/pos1/t0"):
        assert math.isfinite(m[key]), key
    assert 1.0 <= m["val/simulated_tokens_per_call"] <= 4.0          # 3 unrolled steps
    for t in ("t0", "t1"):                                            # the 2,2,1 tree beside the chain
        assert 1.0 <= m[f"val/tree/tokens_per_call/{t}"] <= 3.0 and m[f"val/tree/speedup/{t}"] > 0
        assert 1.0 >= m[f"val/tree/per_position_acceptance/pos1/{t}"] >= m[f"val/tree/per_position_acceptance/pos2/{t}"]
    rows = [json.loads(line) for line in (online["output_dir"] / "speculative_samples.jsonl").read_text().splitlines()]
    assert all(r["matches_base"] for r in rows if r["temperature"] == 0)


def test_label_mask_counts_answer_tokens_only():
    batch = {"tokens": torch.zeros(2, 9, dtype=torch.long), "prompt_len": torch.tensor([3, 1]),
             "valid_len": torch.tensor([6, 9])}
    mask = label_mask(batch, 8)
    # position j predicts token j + 1: row 0 counts tokens 3, 4, 5; row 1 tokens 1..8
    assert mask[0].nonzero()[:, 0].tolist() == [2, 3, 4]
    assert mask[1].nonzero()[:, 0].tolist() == list(range(8))


def test_draft_vocabulary_comes_from_token_counts(hf, tmp_path):
    from train.run import validate
    tok = load_tokenizer(hf["llama"])
    vocab = len(tok)
    counts = [0] * vocab
    for i, c in zip([5, 9, 11, 2, 7], [50, 40, 30, 20, 10], strict=True):
        counts[i] = c
    f = counts_file(tmp_path / "counts.json", tok, counts)
    kwargs = validate(cfg(hf, tmp_path / "r", "head.draft_vocab_size=3", f"head.draft_vocab={f}"))
    assert kwargs["draft_ids"] == [5, 9, 11]


def test_token_counts_are_read_by_what_ids_mean_not_how_a_library_serialized_the_tokenizer(hf, tmp_path):
    # a count file counted under another transformers version of the same tokenizer (found on a GPU
    # machine: transformers 5.17 serialized SmolLM2's GGUF tokenizer unlike 5.24 here) carries another
    # tokenizer_sha256 but the same vocabulary_sha256: accepted; another vocabulary is refused
    from train.draft_vocab import write_counts
    from train.tasks.hf_eagle3 import read_token_counts

    tok, other = load_tokenizer(hf["llama"]), load_tokenizer(hf["mismatch"])
    assert vocabulary_fingerprint(tok) != vocabulary_fingerprint(other)
    counts = torch.arange(len(tok))
    f = write_counts(tmp_path / "c.json", counts, tok, {"test": True})
    data = json.loads(f.read_text())
    assert data["vocabulary_sha256"] == vocabulary_fingerprint(tok)
    assert data["tokenizer_sha256"] == tokenizer_fingerprint(tok)
    data["tokenizer_sha256"] = "0" * 64                                   # another library's serialization
    f.write_text(json.dumps(data))
    assert read_token_counts(f, tok, len(tok)).tolist() == counts.tolist()
    data["vocabulary_sha256"] = vocabulary_fingerprint(other)
    f.write_text(json.dumps(data))
    with pytest.raises(SpecdecError, match="another tokenizer"):
        read_token_counts(f, tok, len(tok))


def test_head_init_layer_starts_the_heads_layer_from_the_targets(hf, tmp_path):
    # head.init_layer=true reaches the module: its decoder layer starts as the target's layer that
    # reads the highest aux layer (hidden_states[2]: the last of the 2-layer target's layers, 1),
    # the fc as the identity on that aux layer
    from train.run import validate
    from train.tasks.hf_eagle3 import HFEagle3Module

    kwargs = validate(cfg(hf, tmp_path / "r", "head.init_layer=true"))
    assert kwargs["init_layer"] is True
    head = HFEagle3Module(**kwargs).head
    target = load_causal_lm(hf["llama"])
    assert len(target.model.layers) == 2
    layer = target.model.layers[1]
    torch.testing.assert_close(head.layers[0].mlp.down_proj.weight, layer.mlp.down_proj.weight)
    H = head.config.hidden_size
    torch.testing.assert_close(head.layers[0].self_attn.q_proj.weight[:, H:], layer.self_attn.q_proj.weight)
    torch.testing.assert_close(head.fc.weight[:, 2 * H:], torch.eye(H))
    assert not validate(cfg(hf, tmp_path / "s"))["init_layer"]                   # off unless asked


@pytest.mark.parametrize("case, message", [
    ("aux_out_of_range", "out of range"),
    ("counts_missing", "head.draft_vocab is not set"),
    ("counts_other_tokenizer", "another tokenizer"),
    ("ttt_steps", "task.ttt_steps"),
    ("tv_weight", "task.tv_weight must be a number >= 0"),
    ("feature_weight", "task.feature_weight must be a number >= 0"),
    ("ttt_ramp", r"task.ttt_ramp must be in \[0, 1\)"),
    ("feature_noise", "task.feature_noise must be a number >= 0"),
    ("other_kind", r"head.kind=prophet is trained by task=hf_prophet"),
    ("init_layer", "head.init_layer must be true or false"),
    ("unknown_kind", r"head.kind must be one of prophet, eagle3, dflash, peagle, got 'medusa'"),
])
def test_bad_input_is_one_line_before_any_work(hf, tmp_path, case, message):
    from train.run import validate
    extra = {"aux_out_of_range": ["head.aux_layers=[1,2,9]"],
             "counts_missing": ["head.draft_vocab_size=8"],
             "ttt_steps": ["task.ttt_steps=0"], "tv_weight": ["task.tv_weight=-1"],
             "feature_weight": ["task.feature_weight=-0.5"], "ttt_ramp": ["task.ttt_ramp=1"],
             "feature_noise": ["task.feature_noise=-0.1"],
             "other_kind": ["head.kind=prophet"],
             "init_layer": ["head.init_layer=3"],
             "unknown_kind": ["head.kind=medusa"]}.get(case, [])
    if case == "counts_other_tokenizer":
        other = load_tokenizer(hf["mismatch"])
        f = counts_file(tmp_path / "c.json", other, [1] * len(load_tokenizer(hf["llama"])))
        extra = ["head.draft_vocab_size=8", f"head.draft_vocab={f}"]
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=message) as err:
        validate(cfg(hf, out, *extra))
    assert "\n" not in str(err.value) and not out.exists()


# ---------------------------------------------------------------- from a multi-layer cache

@pytest.fixture(scope="module")
def caches(hf, tmp_path_factory):
    """Caches of the Llama target's own continuations: the aux layers and the last (what the head
    needs), and the last layer only (what a prophet head needs)."""
    from conftest import hf_cache

    d = tmp_path_factory.mktemp("eagle3_caches")
    common = dict(seq_len=SEQ, windows=24, shard_size="64KB", batch_size=4, seed=2, prompts=hf["prompts"], chat=True,
                  temperatures=[0.0, 1.0])
    return {"full": hf_cache(hf["llama"], d / "full", layers=[0, 1, 2], **common) and d / "full",
            "last": hf_cache(hf["llama"], d / "last", **common) and d / "last"}


def test_a_cached_run_trains_exports_and_the_exported_head_decodes_exactly(hf, caches, tmp_path):
    from specdec_models import load_export
    from specdec_models.decode import GREEDY, HeadDrafter, generate
    from specdec_models.export import read_export_config
    from specdec_models.heads.eagle3 import Eagle3Head

    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}"))
    m = result["metrics"]
    assert result["global_step"] == 6 and math.isfinite(m["val/simulated_tokens_per_call"])
    assert 0 < m["val/draft_vocab_mass"] <= 1.0 + 1e-6
    config = read_export_config(result["export_dir"])
    assert config["kind"] == "hf_eagle3" and config["metadata"]["embeddings"] == "cached"
    model = load_causal_lm(hf["llama"]).eval()
    head = load_export(result["export_dir"], target=model)
    assert isinstance(head, Eagle3Head)
    prompts = [torch.tensor([4, 9, 12]), torch.tensor([7, 5, 20, 21, 6])]
    plain, _ = generate(model, prompts, 12, sampling=GREEDY)
    spec, stats = generate(model, prompts, 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in spec] == [t.tolist() for t in plain] and stats.drafted > 0


def test_a_cache_lacking_the_heads_layers_is_refused_in_one_line(hf, caches, tmp_path):
    from train.run import validate
    with pytest.raises(SpecdecError, match=r"holds hidden states of layers \[2\]; the head needs \[0, 1, 2\]") as err:
        validate(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['last']}"))
    assert "--layers 0,1,2" in str(err.value) and "\n" not in str(err.value)


def test_the_schedule_anneals_within_the_time_budget():
    from train.optim import OptimConfig
    opt = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    # step 100 of 100,000 is early by steps, but with the time budget spent it is at the floor
    assert opt.lr_factor(100, 100_000) > 0.99
    assert opt.lr_factor(100, 100_000, time_fraction=1.0) == pytest.approx(0.1)
    assert opt.lr_factor(100, 100_000, time_fraction=0.5) == pytest.approx(0.55)
    assert opt.lr_factor(5, 100_000, time_fraction=0.9) == pytest.approx(0.6)        # warm-up is by steps


def test_the_ramp_trains_draft_step_one_alone_for_its_share_of_the_steps(hf, tmp_path, monkeypatch):
    # task.ttt_ramp=0.5 over 6 steps: steps 0-2 unroll one draft step, 3-5 all three; validation all
    # three. task.feature_noise: training steps only get noisy features
    import train.tasks.hf_eagle3 as task
    from specdec_models.heads.eagle3 import Eagle3Head
    seen, noised = [], []
    real, real_noise = Eagle3Head.ttt_loss, task.with_noise

    def spy(self, *args, steps=4, **kw):
        seen.append((self.training, steps))
        return real(self, *args, steps=steps, **kw)

    def noise_spy(aux, layers, scale):
        noised.append((layers, scale))
        return real_noise(aux, layers, scale)

    monkeypatch.setattr(Eagle3Head, "ttt_loss", spy)
    monkeypatch.setattr(task, "with_noise", noise_spy)
    out = run(cfg(hf, tmp_path / "run", "task.ttt_ramp=0.5", "task.feature_noise=0.1",
                  "callbacks.speculative_eval=null"))
    assert out["global_step"] == 6
    assert [s for training, s in seen if training] == [1, 1, 1, 3, 3, 3]
    assert {s for training, s in seen if not training} == {3}
    assert noised == [(3, 0.1)] * 6                                              # one per training step


def test_feature_noise_is_scaled_by_each_layers_rms_at_each_position():
    # 3 layers at RMS 1, 10 and 100: the noise over 2 x 500 x 64 draws per layer has std 0.2 x that
    # RMS; the estimate's relative error is about 0.3% (1 / sqrt(2 x 64,000)), so a 3% band fails a
    # correct implementation with probability below 1e-20
    from train.tasks.hf_eagle3 import with_noise
    torch.manual_seed(0)
    scales = torch.tensor([1.0, 10.0, 100.0])
    aux = (torch.randn(2, 500, 3, 64) * scales[:, None]).flatten(-2)
    noisy = with_noise(aux, 3, 0.2)
    parts, clean = noisy.unflatten(-1, (3, 64)), aux.unflatten(-1, (3, 64))
    rms = clean.pow(2).mean(-1, keepdim=True).sqrt()
    ratio = ((parts - clean) / rms).flatten(0, 1).transpose(0, 1).reshape(3, -1).std(-1)
    torch.testing.assert_close(ratio, torch.full((3,), 0.2), rtol=0.03, atol=0)


@pytest.mark.slow     # about 20 s: two processes; test_train_ddp.py keeps two CPU processes training by default
def test_two_cpu_processes_train_the_head_each_on_its_share_of_the_cache(hf, caches, tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "run"
    command = [sys.executable, "-m", "train", "experiment=hf_eagle3", f"target.path={hf['llama']}",
               "data=hf_embeddings",
               f"data.cache={caches['full']}", f"data.seq_len={SEQ}", "data.batch_size=2", "data.val_windows=4",
               "data.val_batch_size=4", "head.draft_vocab_size=null", "head.aux_layers=[0,1,2]", "task.ttt_steps=2",
               "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=4",
               "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
               "callbacks.speculative_eval.num_prompts=2",
               "callbacks.speculative_eval.max_new_tokens=4", f"output_dir={out}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert (out / "export" / "config.json").is_file()


def test_the_precision_bench_times_each_precision_on_the_same_batches_and_names_the_rules_choice(caches, tmp_path,
                                                                                                 capsys):
    """scripts/bench_train.py --eagle3-step: both precisions step their own copy of the head on the
    cache's rows, interleaved; the report holds every timed step, paired ratios and the rule's pick."""
    from conftest import command

    from specdec_models.cpu import fast_precision

    bench_train = command("bench_train")

    out = tmp_path / "bench"
    argv = ["--eagle3-step", str(caches["full"]), "--draft-vocab-size", "0", "--aux-layers", "0,1,2",
            "--ttt-steps", "3", "--rounds", "3", "--out", str(out)]
    assert bench_train.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["precision"]: row for row in report["precisions"]}
    assert list(rows) == ["32-true", "bf16-mixed"] and report["rounds"] == 3
    for row in rows.values():
        assert len(row["seconds"]) == 3 and all(s > 0 for s in row["seconds"])
        pairs = [a / b for a, b in zip(row["seconds"], rows["32-true"]["seconds"], strict=True)]
        assert row["median_ratio_over_32-true"] == pytest.approx(sorted(pairs)[1])
    assert rows["32-true"]["median_ratio_over_32-true"] == 1.0
    assert report["fastest"] == min(rows, key=lambda p: rows[p]["median_seconds"])
    assert report["rule"] == fast_precision("cpu") and report["rule"] in out.with_suffix(".md").read_text()
    for argv, message in [(["--draft-vocab-size", "0", "--precisions", "16-true"], "--precisions"),
                          (["--draft-vocab-size", "8"], "give --draft-vocab"),
                          (["--draft-vocab", str(tmp_path / "none.json")], "does not exist")]:
        capsys.readouterr()
        assert bench_train.main(["--eagle3-step", str(caches["full"]), *argv, "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert bench_train.main(["--eagle3-step", str(tmp_path / "no_cache"), "--draft-vocab-size", "0"]) == 2


@pytest.mark.parametrize("experiment", ["hf_eagle3", "hf_prophet"])
def test_heads_train_under_bf16_mixed_precision_as_the_smollm2_experiments_do(hf, caches, tmp_path, experiment):
    """experiment=smollm2_eagle3 / smollm2_prophet train with trainer.precision=bf16-mixed where the
    machine makes it the faster (specdec_models.cpu.fast_precision): the head's weights stay fp32, its loss is finite
    and falls, and the export is fp32."""
    from specdec_models.export import read_export_config

    if experiment == "hf_eagle3":
        c = cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}",
                "trainer.precision=bf16-mixed",
                "trainer.max_steps=12", "optim.lr=1e-2", "trainer.val_check_interval=12")
    else:
        from test_hf_prophet_task import cfg as p_cfg
        c = p_cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['last']}",
                  "trainer.precision=bf16-mixed", "trainer.max_steps=12", "optim.lr=1e-2",
                  "trainer.val_check_interval=12")
    result = run(c)
    state = torch.load(result["last_ckpt"], weights_only=True)["state_dict"]
    assert all(v.dtype == torch.float32 for k, v in state.items() if v.is_floating_point()), "weights left fp32"
    import csv
    rows = [r for r in csv.DictReader(open(next(result["output_dir"].rglob("metrics.csv")))) if r.get("train/loss")]
    losses = [float(r["train/loss"]) for r in rows]
    assert all(math.isfinite(x) for x in losses) and len(losses) >= 10
    assert sum(losses[-3:]) < sum(losses[:3]), losses            # it learns
    assert read_export_config(result["export_dir"])["kind"] in ("hf_eagle3", "hf_prophet")



def test_the_gpu_experiment_composes_and_validates_for_a_target_of_ones_own(hf, caches, tmp_path):
    """experiment=hf_eagle3_gpu holds the GPU sizes of the head that met the goals (what
    scripts/eagle3.py --device cuda trains with); it names no target: any local one validates."""
    from conftest import CONF

    cfg = train_run.compose(["experiment=hf_eagle3_gpu"])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed" and cfg.target.path is None
    assert (cfg.data.batch_size, cfg.data.num_workers, cfg.task.ttt_steps, cfg.task.ttt_ramp) == (64, 8, 6, 0)
    assert (cfg.trainer.max_time, cfg.trainer.val_check_interval, cfg.optim.warmup_steps) == ("00:00:05:00", 500, 100)
    assert (cfg.recipe.conversations, cfg.recipe.answer_batch, cfg.recipe.chat_cache_batch) == (12000, 2048, 256)
    with pytest.raises(SpecdecError, match="target.path"):
        train_run.validate(cfg)
    cfg = train_run.compose(["experiment=hf_eagle3_gpu", f"target.path={hf['llama']}", f"data.cache={caches['full']}",
                             f"data.seq_len={SEQ}", "data.val_windows=4", *HEAD, f"output_dir={tmp_path / 'run'}"])
    kwargs = train_run.validate(cfg)
    assert kwargs["metadata"]["name"] == "hf_eagle3_gpu"
    first = (CONF / "experiment" / "hf_eagle3_gpu.yaml").read_text().splitlines()
    assert first[0] == "# @package _global_" and first[1].startswith("# Run: python -m train experiment=hf_eagle3_gpu ")

def test_the_acceptance_command_measures_a_trained_head_end_to_end(online, hf, tmp_path, capsys):
    # scripts/compare_hf_drafts.py acceptance on the exported head: one row per temperature > 0,
    # every measure a probability, the decoding's round starts observed exactly. In fp32 whatever
    # the host: `--dtype auto` is bf16 on a CPU with bf16 instructions, where the head's cached
    # logits differ from a fresh computation by bf16 rounding (1.6e-2 on an AMD EPYC with bf16 instructions)
    from conftest import command

    out = tmp_path / "acceptance"
    assert command("compare_hf_drafts").main([
        "acceptance", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}", "--prompts",
        str(hf["prompts"]), "--chat", "--count", "2", "--max-new-tokens", "8", "--temperatures", "0,1",
        "--gamma", "3", "--draws", "2", "--dtype", "float32", "--out", str(out)]) == 0, capsys.readouterr().err
    [row] = json.loads((out / "results.json").read_text())["rows"]
    assert (row["head"], row["prompt_set"], row["temperature"]) == ("tiny", "prompts", 1.0)
    assert row["positions"] >= row["rounds"] >= 2
    assert all(0 <= row[k] <= 1 for k in ("drawn_1", "drawn_3", "top_1", "decoded_1", "round_drawn_1"))
    assert row["round_logit_error"] < 1e-4
    assert 0 <= row["round_kept_token"] <= 3 and 0 <= row["round_kept_block"] <= 3       # chains of 3
    table = (out / "table.md").read_text()
    assert "round_drawn_1" in table and "chains of 3" in table


def test_the_comparison_times_block_and_token_verification_side_by_side(online, hf, tmp_path, capsys):
    # --token-verify adds a token-verified twin of the chain and of each tree of one child per node
    # (not of wider trees); at T=0 the twins emit their drafter's tokens, and the greedy check
    # against transformers leaves them out (it checks the drafters themselves). --eagle3-auto adds the
    # head at gamma auto, checked like the others
    from conftest import command

    out = tmp_path / "compare"
    assert command("compare_hf_drafts").main([
        "compare", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}", "--tree", "3,1,1,0.2",
        "--tree", "2,2,1", "--token-verify", "--eagle3-auto", "--prompts", str(hf["prompts"]), "--chat", "--count",
        "2", "--batch1-count", "2", "--batch1-only", "--max-new-tokens", "8", "--rounds", "1", "--gamma", "3",
        "--check-count", "1", "--dtype", "float32", "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "results.json").read_text())
    methods = ["plain", "eagle3 tiny", "eagle3 tiny (token verify)", "eagle3 tiny gamma auto",
               "eagle3 tiny tree 3,1,1, q >= 0.2", "eagle3 tiny tree 3,1,1, q >= 0.2 (token verify)",
               "eagle3 tiny tree 2,2,1"]
    assert [r["method"] for r in report["rows"]] == methods * 2            # T=0, then T=1
    greedy = {r["method"]: r["new_tokens"] for r in report["rows"] if r["temperature"] == 0}
    assert len(set(greedy.values())) == 1
    assert set(report["greedy_equals_transformers_generate"]) == {m for m in methods if "token verify" not in m}
    assert all(report["greedy_equals_transformers_generate"].values())


def test_the_comparison_races_the_chain_at_several_gammas_at_batch_8_only(online, hf, tmp_path, capsys):
    # --eagle3-gamma 1 2 decodes a chain per gamma, named by it; --batch1-count 0 leaves out batch 1
    # (the batch-8 study of docs/results.md). At T=0 every chain emits plain decoding's tokens, and a
    # chain at gamma g drafts at most g tokens a row-call
    from conftest import command

    out = tmp_path / "compare"
    assert command("compare_hf_drafts").main([
        "compare", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}", "--eagle3-gamma", "1,2",
        "--prompts", str(hf["prompts"]), "--chat", "--count", "2", "--batch1-count", "0", "--max-new-tokens",
        "8", "--rounds", "1", "--check-count", "1", "--dtype", "float32", "--temperatures", "0",
        "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["plain", "eagle3 tiny gamma 1", "eagle3 tiny gamma 2"]
    assert {r["batch"] for r in rows.values()} == {8}
    assert all(r["greedy_equal_plain"] for r in rows.values())
    for gamma in (1, 2):
        row = rows[f"eagle3 tiny gamma {gamma}"]
        assert 0 < row["drafted"] <= gamma * row["row_calls"]
    assert report["greedy_equals_transformers_generate"] == {"plain": True, "eagle3 tiny gamma 1": True,
                                                             "eagle3 tiny gamma 2": True}
    assert (out / "compare.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--batch1-count", "0", "--batch1-only"], "--batch1-count must be >= 0, and >= 1 with --batch1-only"),
    (["--eagle3-gamma", "2,2"], "--eagle3-gamma takes distinct gammas >= 1"),
])
def test_the_comparison_refuses_an_empty_or_repeated_setting(online, hf, tmp_path, capsys, argv, message):
    from conftest import command

    code = command("compare_hf_drafts").main([
        "compare", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}", "--prompts",
        str(hf["prompts"]), *argv, "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- starting from an export

@pytest.fixture(scope="module")
def start_export(hf, tmp_path_factory):
    """An hf_eagle3 export for the Llama target with an 8-token draft vocabulary and random weights:
    what head.init_from starts from."""
    from specdec_models.export import save_export
    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head

    target = load_causal_lm(hf["llama"]).eval()
    config = Eagle3Config.for_target(target, draft_vocab_size=8, aux_layers=[0, 1, 2],
                                     vocab_size=len(load_tokenizer(hf["llama"])))
    torch.manual_seed(5)
    head = Eagle3Head(config, target, torch.tensor([2, 3, 5, 8, 13, 21, 30, 34]))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))                 # not the weights a fresh head starts with
    return save_export(tmp_path_factory.mktemp("start") / "export", head)


def test_a_head_starts_from_an_exports_weights_and_draft_vocabulary(hf, start_export, tmp_path):
    from specdec_models.export import read_export_config, read_export_tensors
    from train.run import validate
    from train.tasks.hf_eagle3 import HFEagle3Module

    kwargs = validate(cfg(hf, tmp_path / "r", "head.draft_vocab_size=8", f"head.init_from={start_export}"))
    assert kwargs["draft_ids"] == [2, 3, 5, 8, 13, 21, 30, 34]        # the export's, with no token counts given
    # head.init_layer=true (experiment=smollm2_eagle3's default) gives way: the export's weights are the start
    assert not validate(cfg(hf, tmp_path / "q", "head.draft_vocab_size=8", f"head.init_from={start_export}",
                            "head.init_layer=true"))["init_layer"]
    saved = read_export_tensors(start_export)
    state = HFEagle3Module(**kwargs).head.state_dict()
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    tok = load_tokenizer(hf["llama"])
    counts = counts_file(tmp_path / "c.json", tok, list(range(len(tok))))
    fresh = HFEagle3Module(**validate(cfg(hf, tmp_path / "s", "head.draft_vocab_size=8", f"head.draft_vocab={counts}")))
    assert not torch.equal(fresh.head.fc.weight, saved["fc.weight"])  # without init_from the head starts afresh

    result = run(cfg(hf, tmp_path / "run", "head.draft_vocab_size=8", f"head.init_from={start_export}"))
    assert result["global_step"] == 6
    config = read_export_config(result["export_dir"])
    assert config["metadata"]["init_from"] == {"path": str(start_export.resolve()),
                                               "weights_sha256": read_export_config(start_export)["weights_sha256"]}
    trained = read_export_tensors(result["export_dir"])
    assert torch.equal(trained["d2t"], saved["d2t"])                   # the draft vocabulary kept
    assert not torch.equal(trained["fc.weight"], saved["fc.weight"])   # and trained on


@pytest.mark.parametrize("case, message", [
    ("missing", r"head.init_from: export directory .* does not exist"),
    ("shapes", r"holds a head of other shapes: aux_layers \[0, 1, 2\] \(this run: \[1, 2\]\)"),
    ("other_target", "holds a head for another target"),
    ("other_vocab", "chooses another draft vocabulary than the export"),
    ("not_eagle3", "holds an export of kind hf_prophet; the head starts from an hf_eagle3 export"),
])
def test_a_bad_start_export_is_one_line_before_any_work(hf, start_export, tmp_path, case, message):
    from specdec_models.export import save_export
    from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
    from train.run import validate

    tok = load_tokenizer(hf["llama"])
    start = start_export
    extra = {"shapes": ["head.aux_layers=[1,2]"],
             "other_vocab": [f"head.draft_vocab={counts_file(tmp_path / 'c.json', tok, list(range(len(tok))))}"]}
    if case == "missing":
        start = tmp_path / "nothing"
    if case == "not_eagle3":
        target = load_causal_lm(hf["llama"])
        start = save_export(tmp_path / "prophet", HFProphet(HFProphetConfig.for_target(target, dim=16, dim_head=8),
                                                            target))
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=message) as err:
        validate(cfg(hf, out, "head.draft_vocab_size=8", f"head.init_from={start}", *extra.get(case, []),
                     target="other" if case == "other_target" else "llama"))
    assert "\n" not in str(err.value) and not out.exists()


def test_a_datastore_of_the_caches_answers_drafts_in_the_comparison_and_the_cli(online, hf, caches, tmp_path, capsys):
    # `datastore` writes the answers of a regenerated cache's training rows with the target's
    # vocabulary fingerprint; `compare --datastore` adds a "+ datastore" row to each tree with a
    # lookup (not to one without), checked against transformers like the others; the decoding CLI
    # drafts with it; a datastore of another tokenizer is refused in one line by both
    from conftest import command
    from test_decode_cli import cli

    from specdec_models.decode.datastore import Datastore
    from train.data.regenerate import cache_answers

    script = command("compare_hf_drafts")
    store_file = tmp_path / "store.npz"
    assert script.main(["datastore", "--target", str(hf["llama"]), "--cache", str(caches["full"]),
                        "--val-windows", "4", "--out", str(store_file)]) == 0, capsys.readouterr().err
    store = Datastore.load(store_file)
    answers = cache_answers(caches["full"], 4)
    assert store.rows == answers and len(answers) == 24 - 4 and all(answers)
    assert store.source["vocabulary_sha256"] == vocabulary_fingerprint(load_tokenizer(hf["llama"]))
    out = tmp_path / "compare"
    assert script.main([
        "compare", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}", "--tree", "2,2,1,2..8",
        "--tree", "2,2,1", "--datastore", str(store_file), "--prompts", str(hf["prompts"]), "--chat", "--count", "2",
        "--batch1-count", "2", "--batch1-only", "--max-new-tokens", "8", "--rounds", "1", "--gamma", "3",
        "--temperatures", "0", "--check-count", "1", "--dtype", "float32",
        "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "results.json").read_text())
    methods = ["plain", "eagle3 tiny", "eagle3 tiny tree 2,2,1 + lookup 2..8",
               "eagle3 tiny tree 2,2,1 + lookup 2..8 + datastore", "eagle3 tiny tree 2,2,1"]
    assert [r["method"] for r in report["rows"]] == methods
    assert report["greedy_equals_transformers_generate"] == dict.fromkeys(methods, True)
    capsys.readouterr()
    common = ("--hf-model", hf["llama"], "--eagle3", online["export_dir"], "--prompt", "a b c", "--temperature", 0,
              "--max-new-tokens", 8, "--ignore-eos", "--json", "--dtype", "float32", "--tree", "2,2,1,2..8")
    status, with_store, err = cli(capsys, *common, "--datastore", store_file)
    assert status == 0, err
    status, without, err = cli(capsys, *common)
    assert status == 0, err
    assert json.loads(with_store)["continuations"] == json.loads(without)["continuations"]
    foreign = tmp_path / "foreign.npz"
    Datastore(answers).save(foreign, {"vocabulary_sha256": "0" * 64})
    status, _, err = cli(capsys, *common, "--datastore", foreign)
    assert status == 2 and "another tokenizer" in err and err.count("\n") == 1
    assert script.main(["compare", "--target", str(hf["llama"]), "--eagle3", f"tiny={online['export_dir']}",
                        "--tree", "2,2,1,2", "--datastore", str(foreign), "--prompts", str(hf["prompts"]), "--chat",
                        "--count", "2", "--batch1-only", "--out", str(tmp_path / "c2")]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    status, _, err = cli(capsys, *common[:-2], "--tree", "2,2,1", "--datastore", store_file)
    assert status == 2 and "with a lookup" in err and err.count("\n") == 1


def test_a_checkpoint_from_another_machine_exports_with_its_target_path_replaced(online, hf, tmp_path, capsys):
    # a checkpoint made on a GPU box records that box's target path: `scripts/export.py --set
    # target_path=...` exports it here, the same export as the run's own; another model is refused by
    # the weights hash the checkpoint recorded, and a setting it lacks or holds as no text in one line
    from conftest import command

    ckpt = torch.load(online["last_ckpt"], map_location="cpu", weights_only=False)
    elsewhere = tmp_path / "gpu-box" / "llama"
    ckpt["hyper_parameters"]["target_path"] = str(elsewhere)
    moved = tmp_path / "moved.ckpt"
    torch.save(ckpt, moved)
    export = command("export")
    assert export.main([str(moved), str(tmp_path / "a")]) == 2
    assert str(elsewhere) in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert export.main([str(moved), str(tmp_path / "b"), "--set", f"target_path={hf['llama']}"]) == 0
    exported = json.loads((tmp_path / "b" / "config.json").read_text())
    own = json.loads((online["export_dir"] / "config.json").read_text())
    assert exported["weights_sha256"] == own["weights_sha256"]
    capsys.readouterr()
    for setting, message in ((f"target_path={hf['other']}", "holds other weights"),
                             ("nope=x", "records no setting 'nope'"), ("head=x", "'head' of")):
        assert export.main([str(moved), str(tmp_path / "c"), "--set", setting]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]   # not the loading bar
        assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "c").exists()


def test_train_and_val_loss_are_one_quantity_during_the_ramp_and_after(hf, caches, tmp_path, monkeypatch):
    """train/loss and val/loss both log the loss per unrolled step over the steps the training
    unrolls at that point (one in task.ttt_ramp, all ttt_steps after); val/loss_all_steps over all
    steps. On one batch at one ramp state the training step and the validation log the same
    number; in a run, validation in the ramp logs the one-step figure beside the all-step one."""
    import csv

    from train.data.hf_embeddings import HFEmbeddingsDataModule
    from train.tasks.hf_eagle3 import HFEagle3Module

    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}", "task.ttt_ramp=0.5",
                     "trainer.val_check_interval=2", "callbacks.speculative_eval=null"))
    rows = [r for r in csv.DictReader(open(next(result["output_dir"].rglob("metrics.csv")))) if r.get("val/loss")]
    val = {int(r["step"]): (float(r["val/loss"]), float(r["val/loss_all_steps"])) for r in rows}
    ramp, after = val[min(val)], val[max(val)]          # validation after step 2 (of 6: in the ramp) and the last
    assert ramp[0] != ramp[1] and after[0] == after[1], val

    module = HFEagle3Module.load_from_checkpoint(result["last_ckpt"], weights_only=False)
    batch = HFEmbeddingsDataModule(cache=str(caches["full"]), seq_len=SEQ, val_windows=4).validation_batch()
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(module, "log_train", lambda loss, parts: logged.__setitem__("train/loss", float(loss)))
    figures = {}
    for steps in (1, 3):
        monkeypatch.setattr(module, "trained_steps", lambda steps=steps: steps)
        with torch.no_grad():
            module.train().training_step(batch, 0)          # no feature noise, no dropout: train mode computes as eval
            module.eval().evaluate(batch, "val")
        assert logged["train/loss"] == pytest.approx(logged["val/loss"], rel=1e-5), (steps, logged)
        figures[steps] = dict(logged)
    assert figures[1]["val/loss_all_steps"] == pytest.approx(figures[3]["val/loss"], rel=1e-5)
    assert figures[1]["val/loss"] != pytest.approx(figures[1]["val/loss_all_steps"], rel=1e-3)
