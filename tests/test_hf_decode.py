"""Hugging Face causal LMs as target and draft of `generate`: the adapter's per-row cache against
uncached forwards, greedy exactness against `model.generate`, batch invariance, losslessness
(chi-square, with an HF draft and with a prophet head), vocabularies and bad input. Tiny random
GPT-NeoX and Llama models, saved and loaded back with `from_pretrained` as a user would."""

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decode import chi_square_p_value, correction_from_p

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, SpecdecError
from specdec_models.decode import GREEDY, DraftModel, HeadDrafter, generate
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
from specdec_models.hf import HFDecoder
from specdec_models.sampling import SamplingConfig, to_probs

V = 96


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def neox_config(vocab=V, hidden=64):
    return transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=2 * hidden, max_position_embeddings=256, bos_token_id=0,
                                      eos_token_id=None, pad_token_id=0)


def llama_config(vocab=V, hidden=32):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=256,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=0)


def build(path, arch, seed, sharpen, vocab=V, noise=None, attn="sdpa"):
    """A seeded random causal LM whose head is scaled by `sharpen` (random heads give nearly uniform
    logits), saved to `path` and loaded back through AutoModelForCausalLM. `noise`: (model, scale)
    to load a perturbed copy of another model instead."""
    torch.manual_seed(seed)
    if noise is not None:
        model, scale = copy.deepcopy(noise[0]), noise[1]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn_like(p))
    else:
        cls, cfg = ((transformers.GPTNeoXForCausalLM, neox_config(vocab)) if arch == "neox"
                    else (transformers.LlamaForCausalLM, llama_config(vocab)))
        model = cls(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=attn)
    return loaded.float().eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    neox = build(d / "neox", "neox", 0, 20.0)
    llama = build(d / "llama", "llama", 1, 30.0)
    return {
        "neox": neox,
        "llama": llama,
        "neox_draft": build(d / "neox_draft", "neox", 2, 20.0),
        "llama_draft": build(d / "llama_draft", "llama", 3, 30.0),
        "neox_near": build(d / "neox_near", None, 4, None, noise=(neox, 0.002)),   # agrees about half the time
        "llama_near": build(d / "llama_near", None, 5, None, noise=(llama, 0.002)),
    }


def ragged_prompts(seed=1, lengths=(3, 9, 1, 6, 2)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


def hf_greedy(model, prompts, n):
    """The model's own greedy `generate`, one row at a time and as one left-padded batch."""
    alone = []
    for p in prompts:
        out = model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        alone.append(out[0, p.numel():].tolist())
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return alone, batched[:, width:].tolist()


# ---------------------------------------------------------------- the adapter's cache

@pytest.mark.parametrize("arch", ["neox", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("slack", [0, 64], ids=["compact-always", "keep-holes"])
def test_adapter_with_ragged_per_row_rollback_matches_uncached_forward(tmp_path, arch, attn, slack):
    model = build(tmp_path / arch, arch, 7, 20.0, attn=attn)
    dec = HFDecoder(model, slack=slack)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (3, 60), generator=g)
    with torch.no_grad():
        full = model(x).logits                                  # each row's uncached forward
    cache = dec.new_cache(3, 60)
    out = dec(x[:, :12], cache=cache).logits                    # prefill, as generate does: then rows shorten
    torch.testing.assert_close(out, full[:, :12], rtol=1e-5, atol=1e-5)
    cache.rollback(torch.tensor([12, 5, 1]))
    for step in range(12):
        n = 1 + step % 4
        start = cache.lengths.clone()
        new = torch.stack([x[i, start[i]:start[i] + n] for i in range(3)])
        out = dec(new, cache=cache).logits
        for i in range(3):
            torch.testing.assert_close(out[i], full[i, start[i]:start[i] + n], rtol=1e-5, atol=1e-5)
        assert cache.lengths.tolist() == (start + n).tolist()
        # every row keeps a different count of the new tokens (0 .. n), as verify rollbacks do
        keep = start + torch.randint(0, n + 1, (3,), generator=g)
        cache.rollback(keep)
        assert cache.slots <= int(keep.max()) + slack
    assert cache.slots >= int(cache.lengths.max())


def test_the_adapter_passes_its_cache_by_the_name_the_model_takes(models):
    """transformers >= 5.24 takes the KV cache as `cache` (past_key_values is deprecated, removed in
    5.40); older versions as `past_key_values`: the adapter asks the model's forward which."""
    import inspect
    import warnings

    from specdec_models.hf.adapter import cache_argument

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            pass

    assert cache_argument(Old()) == "past_key_values" and cache_argument(New()) == "cache"
    model = models["llama"]
    assert cache_argument(model) == ("cache" if "cache" in inspect.signature(type(model).forward).parameters
                                     else "past_key_values")
    dec = HFDecoder(model)
    cache = dec.new_cache(1, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)                 # no deprecated argument passed
        dec(torch.tensor([[1, 2, 3]]), cache=cache)
    assert cache.lengths.tolist() == [3]


def test_adapter_slices_logits_and_refuses_models_without_a_causal_head(models, tmp_path):
    x = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        full = models["neox"](x).logits
    torch.testing.assert_close(HFDecoder(models["neox"], vocab_size=90)(x).logits, full[..., :90])
    bare = transformers.LlamaModel(llama_config())
    with pytest.raises(SpecdecError, match="AutoModelForCausalLM"):
        HFDecoder(bare)
    with pytest.raises(SpecdecError, match="vocab_size"):
        HFDecoder(models["neox"], vocab_size=V + 1)


# ---------------------------------------------------------------- greedy exactness

PAIRS = [("neox", "llama_draft"), ("llama", "neox_draft"), ("neox", "neox_near"), ("llama", "llama_near")]


@pytest.mark.parametrize("target, draft", PAIRS)
def test_greedy_speculative_with_hf_models_matches_hf_generate(models, target, draft):
    prompts = ragged_prompts()
    alone, batched = hf_greedy(models[target], prompts, 24)
    assert batched == alone                                    # the reference agrees with itself
    for gamma in (1, 4):
        got, stats = generate(models[target], prompts, 24, DraftModel(models[draft]), sampling=GREEDY, gamma=gamma)
        assert [t.tolist() for t in got] == alone
    one, _ = generate(models[target], [prompts[1]], 24, DraftModel(models[draft]), sampling=GREEDY, gamma=3)
    assert one[0].tolist() == alone[1]                         # batch 1
    base, _ = generate(models[target], prompts, 24, sampling=GREEDY)
    assert [t.tolist() for t in base] == alone
    if draft.endswith("near"):
        assert 0.0 < stats.acceptance_rate < 1.0                # ragged acceptance really happened


def test_each_row_alone_gives_the_tokens_it_gives_in_a_batch(models):
    prompts = ragged_prompts(seed=5, lengths=(4, 11, 2, 7, 1, 5))
    batch, _ = generate(models["llama"], prompts, 30, DraftModel(models["llama_near"]), sampling=GREEDY, gamma=5)
    for i, p in enumerate(prompts):
        alone, _ = generate(models["llama"], [p], 30, DraftModel(models["llama_near"]), sampling=GREEDY, gamma=5)
        assert alone[0].tolist() == batch[i].tolist()
    # a different batch composition (other rows, other order) leaves each row unchanged too
    sub = [prompts[4], prompts[1], prompts[3]]
    again, _ = generate(models["llama"], sub, 30, DraftModel(models["llama_near"]), sampling=GREEDY, gamma=5)
    assert [t.tolist() for t in again] == [batch[4].tolist(), batch[1].tolist(), batch[3].tolist()]


def test_a_native_decoder_draft_works_with_an_hf_target(models):
    torch.manual_seed(9)
    draft = Decoder(ModelConfig(vocab_size=V, dim=32, depth=1, heads=2, dim_head=16, max_seq_len=128)).eval()
    prompts = ragged_prompts()
    alone, _ = hf_greedy(models["neox"], prompts, 16)
    got, _ = generate(models["neox"], prompts, 16, DraftModel(draft), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in got] == alone


def test_sampling_with_a_copy_of_the_hf_target_as_draft_accepts_everything(models):
    # p == q at every drafted position iff both HF caches are right after every round (catch-up
    # after a full acceptance, per-row rollback after a rejection).
    g = torch.Generator().manual_seed(5)
    target = models["neox"]
    _, stats = generate(target, ragged_prompts(), 40, DraftModel(copy.deepcopy(target)), gamma=4,
                        sampling=SamplingConfig(temperature=0.8, top_k=20), generator=g)
    assert stats.acceptance_rate == 1.0
    assert stats.alpha == pytest.approx(1.0, abs=1e-5)


def test_every_row_emits_exactly_max_new_tokens_and_stops_at_eos(models):
    target, draft = models["llama"], models["llama_near"]
    g = torch.Generator().manual_seed(0)
    got, stats = generate(target, ragged_prompts(), 13, DraftModel(draft), gamma=6, generator=g)
    assert [len(t) for t in got] == [13] * 5 and stats.new_tokens == 65
    plain, _ = hf_greedy(target, ragged_prompts(), 20)
    eos = plain[1][6]
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    got, _ = generate(target, ragged_prompts(), 20, DraftModel(copy.deepcopy(target)), sampling=GREEDY, gamma=6,
                      eos_id=eos)
    assert [t.tolist() for t in got] == expected


# ---------------------------------------------------------------- losslessness

@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """An 8-token GPT-NeoX target whose distributions depend on position and prefix, a Llama draft,
    and a random prophet head (narrower than the target: both projections), each accepted part of
    the time."""
    d = tmp_path_factory.mktemp("toy")
    target = build(d / "t", "neox", 11, 6.0, vocab=8)
    draft = build(d / "d", "llama", 12, 8.0, vocab=8)
    torch.manual_seed(12)
    head = HFProphet(HFProphetConfig.for_target(target, dim=16, dim_head=8, depth=2, prophet_train_length=6),
                     target).eval()
    with torch.no_grad():
        head.prophet.to_logits.proj.weight.mul_(8.0)
    return {"target": target, "draft": draft, "prophet": head}


def toy_samples(toy, drafter, n, **kw):
    """(observed counts, exact probabilities, stats) of the 512 joint outcomes of the 3 tokens the
    toy target emits after a fixed prompt, n samples with gamma 2 drafted by toy[drafter]; the
    exact joint by enumeration under the same sampling settings."""
    target = toy["target"]
    prompt = torch.tensor([1, 4, 2])
    g = torch.Generator().manual_seed(1234)
    wrap = DraftModel if drafter == "draft" else HeadDrafter
    tokens, stats = generate(target, prompt.expand(n, -1), 3, wrap(toy[drafter]), sampling=SamplingConfig(**kw),
                             gamma=2, generator=g)
    index = (torch.stack(tokens) * torch.tensor([64, 8, 1])).sum(1)
    with torch.no_grad():                                # exact joint of 3 tokens by enumeration
        seqs = torch.cartesian_prod(*[torch.arange(8)] * 3)                        # (512, 3)
        x = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
        probs = to_probs(target(x[:, :-1]).logits[:, prompt.numel() - 1:], SamplingConfig(**kw))
        exact = probs.gather(-1, seqs[..., None])[..., 0].prod(-1)
    return torch.bincount(index, minlength=512).float(), exact, stats


@pytest.mark.parametrize("drafter", ["draft", "prophet"])
@pytest.mark.parametrize("setting", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}],
                         ids=["t1", "t0.7-topp0.9"])
def test_speculative_sampling_with_hf_models_is_lossless_chi_square(toy, drafter, setting):
    # 8 tokens, 3 emitted (512 joint outcomes), 6,000 samples, gamma 2 so rows go through
    # rejections, corrections and bonus tokens with ragged per-row HF cache rollbacks. The prophet
    # head drafts from the first round on (the prompt holds its S = 2 positions), from the hidden
    # states the target's cache keeps. Threshold p < 1e-4: a correct sampler fails at most once
    # in 10^4 runs (never here: the seeds are fixed); the correction drawn from p instead of the
    # residual gives p < 1e-20 (next test).
    n = 6000
    observed, exact, stats = toy_samples(toy, drafter, n, **setting)
    assert stats.method == drafter and stats.drafted > 0
    assert 0.05 < stats.acceptance_rate < 0.95, "the toy draft must be neither perfect nor useless"
    assert chi_square_p_value(observed, exact, n) > 1e-4


@pytest.mark.parametrize("drafter", ["draft", "prophet"])
def test_hf_chi_square_catches_a_correction_drawn_from_p(toy, drafter, monkeypatch):
    correction_from_p(monkeypatch)                    # block verification's, the default, and token's
    observed, exact, _ = toy_samples(toy, drafter, 6000, temperature=1.0)
    assert chi_square_p_value(observed, exact, 6000) < 1e-20


# ---------------------------------------------------------------- vocabularies and bad input

def test_a_padded_head_is_sliced_to_the_shared_vocabulary(models, tmp_path):
    # Pythia's case: the draft's head has more rows than the tokenizer; slicing to the shared
    # vocabulary decodes exactly like the target alone.
    padded = build(tmp_path / "padded", "llama", 3, 30.0, vocab=V + 8)
    prompts = ragged_prompts()
    alone, _ = hf_greedy(models["neox"], prompts, 12)
    for vocab_size in (V, "min"):
        got, _ = generate(models["neox"], prompts, 12, DraftModel(padded), sampling=GREEDY, gamma=3,
                          vocab_size=vocab_size)
        assert [t.tolist() for t in got] == alone
    with pytest.raises(SpecdecError, match="vocabulary") as err:
        generate(models["neox"], prompts, 4, DraftModel(padded))
    assert "vocab_size" in str(err.value) and "\n" not in str(err.value)
    # padded target, shorter draft: the target's logits are sliced
    sliced, _ = generate(padded, prompts, 12, DraftModel(models["neox"]), sampling=GREEDY, vocab_size="min")
    base, _ = generate(HFDecoder(padded, vocab_size=V), prompts, 12, sampling=GREEDY)
    assert [t.tolist() for t in sliced] == [t.tolist() for t in base]


@pytest.mark.parametrize("case, message", [
    ("vocab_size_too_big", "exceeds"),
    ("vocab_size_bad", "vocab_size"),
    ("native_draft_other_vocab", "vocabulary"),
    ("prophet_with_hf_target", "Hugging Face target"),
    ("token_outside_shared_vocab", "outside the vocabulary"),
])
def test_bad_input_with_hf_models_gives_a_one_line_error(models, case, message):
    args = {"target": models["neox"], "prompt": torch.tensor([[1, 2, 3]]), "max_new_tokens": 4}
    if case == "vocab_size_too_big":
        args.update(drafter=DraftModel(models["llama_draft"]), vocab_size=V + 1)
    elif case == "vocab_size_bad":
        args.update(drafter=DraftModel(models["llama_draft"]), vocab_size="max")
    elif case == "native_draft_other_vocab":
        args.update(drafter=DraftModel(Decoder(ModelConfig(vocab_size=V + 2, dim=16, depth=1, heads=1, dim_head=16,
                                                           max_seq_len=64))))
    elif case == "prophet_with_hf_target":
        main = ModelConfig(vocab_size=V, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=64)
        prophet = ProphetConfig(model=ModelConfig(vocab_size=V, dim=16, depth=1, heads=1, dim_head=16, max_seq_len=32),
                                prophet_train_length=6, num_leading_start_tokens=2)
        args.update(drafter=HeadDrafter(ModelWithProphet(main, prophet)))
    else:
        args.update(drafter=DraftModel(models["llama_draft"]), vocab_size=50, prompt=torch.tensor([[1, 60, 3]]))
    with pytest.raises(SpecdecError, match=message) as err:
        generate(**args)
    assert "\n" not in str(err.value)


def test_specdec_models_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"       # any import of it now fails
            "import specdec_models, specdec_models.decode, specdec_models.hf\n"
            "from specdec_models.hf import is_hf_model; assert not is_hf_model(object())")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compare_hf_script_runs_on_tiny_local_models(tmp_path, capsys):
    import json

    from conftest import command

    target = build(tmp_path / "target", "neox", 0, 20.0)
    build(tmp_path / "draft", None, 4, None, noise=(target, 0.002))
    script = command("compare_hf")
    out = tmp_path / "compare.json"
    assert script.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                        "--max-new-tokens", "8", "--repeats", "1", "--batch", "3", "--device", "cpu",
                        "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    # every method emits the target's own greedy tokens
    assert all(results[name]["equal"] for name in ("hf", "hf_assisted", "specdec_base", "specdec_draft"))
    assert results["specdec_draft"]["tokens_per_call"] >= 1.0
    assert results["specdec_draft_batch3"]["tokens_per_second"] > 0
    assert "specdec_draft" in capsys.readouterr().out
