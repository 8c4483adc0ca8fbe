"""The hidden-state cache of a Hugging Face target (train.data.regenerate.build_hf_cache,
train.data.embeddings_cache): several layers per row from one pass (an EAGLE-3-class head's aux layers),
int8 scales per token and per layer, the one-line refusal of a cache lacking a layer, format-3
caches still read, and regenerated rows that stop at the end-of-turn token with their valid_len.
Tiny random Llama targets (4 layers, hidden 32) over a word-level tokenizer."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import command, hf_cache
from test_hf_data import build_tokenizer, stopping_target, text_setup
from test_hf_distill import save_model

from specdec_models.errors import SpecdecError
from specdec_models.hf.weights import load_causal_lm
from train.data.embeddings_cache import cache_rows, check_cache, open_cache, pack_embeds, read_cache_meta, unpack_embeds
from train.data.regenerate import continued_prompts, stop_token

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

SEQ = 16
DEPTH = 4
COMMON = dict(seq_len=SEQ, windows=12, shard_size="8KB", batch_size=4, seed=1)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    setup = text_setup(tmp_path_factory.mktemp("hf_cache"), docs=100, prompt_docs=8)
    d, tok = setup["root"], setup["tok"]
    eager = d / "eager"
    stopping_target(eager, tok, depth=DEPTH)               # its rows stop at EOS
    return {**setup, "deep": save_model(d / "deep", tok, "llama", 1, depth=DEPTH), "eager": eager}


@pytest.fixture(scope="module")
def caches(hf):
    """Text-window caches of the 4-layer target: layers [2, -1, 0] in bfloat16 and int8, and the default."""
    d = hf["root"] / "caches"
    made = {dtype: hf_cache(hf["deep"], d / dtype, text=[str(hf["corpus"])], layers=[2, -1, 0], dtype=dtype,
                                  **COMMON) for dtype in ("bfloat16", "int8")}
    lines = []
    made["default"] = hf_cache(hf["deep"], d / "default", text=[str(hf["corpus"])], report=lines.append,
                                     **COMMON)
    made["report"] = lines
    return d, made


def hidden_states(path, tokens):
    model = load_causal_lm(path)
    with torch.no_grad():
        return model(tokens, output_hidden_states=True).hidden_states      # depth + 1 of (b, n, dim)


# ---------------------------------------------------------------- several layers per row

@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_each_cached_layer_is_the_targets_hidden_state_at_that_index_within_one_rounding(hf, caches, dtype):
    d, _ = caches
    meta = read_cache_meta(d / dtype)
    assert (meta["layers"], meta["depth"], meta["dim"], meta["format_version"]) == ([2, 4, 0], DEPTH, 32, 4)
    batch = cache_rows(open_cache(d / dtype, meta), np.arange(12), meta)
    assert batch["embeds"].shape == (12, SEQ, 3 * 32)
    states = hidden_states(hf["deep"], batch["tokens"][:, :-1])
    for k, layer in enumerate(meta["layers"]):
        cached, online = batch["embeds"][..., 32 * k: 32 * (k + 1)].float(), states[layer]
        scale = online.abs().amax(-1, keepdim=True)                            # this token's, this layer's
        error = ((cached - online).abs() / scale).max().item()
        assert error <= (2 ** -8 if dtype == "bfloat16" else 0.5 / 127) + 1e-6, layer
    if dtype == "int8":                     # one scale per token and layer: each layer's absmax / 127
        scales = np.stack(open_cache(d / dtype, meta)[:]["scales"].to_numpy(zero_copy_only=False)).reshape(12, SEQ, 3)
        expected = torch.stack([states[i].abs().amax(-1) for i in meta["layers"]], -1) / 127
        np.testing.assert_allclose(scales, expected.numpy(), rtol=1e-5)
        assert (expected[..., 1] / expected[..., 2]).min() > 10        # a shared scale would flatten layer 0


def test_int8_keeps_a_quiet_layer_next_to_one_with_a_massive_activation():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 64)                                     # (b, n, layers, d)
    x[:, :, 1, 7] = 3000.0                                           # one massive activation in the middle layer
    packed = pack_embeds(x.flatten(2), "int8", layers=3)
    assert packed["scales"].shape == (2, 15)
    back = unpack_embeds(packed["embeds"], "int8", 5, packed["scales"], layers=3).view(2, 5, 3, 64)
    error = (back - x).abs() / x.abs().amax(-1, keepdim=True)
    assert error.max() <= 0.5 / 127 + 1e-6                           # every layer to its own precision


def test_the_default_cache_is_the_last_layer_alone_as_before(hf, caches):
    d, made = caches
    meta = read_cache_meta(d / "default")
    assert meta["layers"] == [DEPTH] and made["default"]["layers"] == [DEPTH]
    default = cache_rows(open_cache(d / "default", meta), np.arange(12), meta)
    several = cache_rows(open_cache(d / "bfloat16"), np.arange(12), read_cache_meta(d / "bfloat16"))
    assert default["embeds"].shape == (12, SEQ, 32) and set(default) == {"tokens", "embeds"}
    assert torch.equal(default["embeds"], several["embeds"][..., 32:64])     # layer 4 of [2, 4, 0], the same pass
    assert any("1 layer(s) [4] of dim 32" in line for line in made["report"])


def test_the_printed_size_counts_every_layer(hf, tmp_path):
    lines = []
    meta = hf_cache(hf["deep"], tmp_path / "c", text=[str(hf["corpus"])], layers=[1, 2, 3, 4],
                          dtype="int8", report=lines.append, **COMMON)
    per_row = SEQ + 1 + SEQ * 4 * (32 + 4) + 8                      # tokens (uint8), int8 + scales, offset
    assert f"{per_row:,} bytes" in lines[0] and "4 layer(s) [1, 2, 3, 4]" in lines[0]
    assert meta["bytes"] >= per_row * 12


def test_the_datamodule_gives_every_layer_concatenated_in_the_caches_order(caches):
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    d, _ = caches
    data = HFEmbeddingsDataModule(cache=str(d / "bfloat16"), seq_len=SEQ, batch_size=4, val_windows=4)
    data.setup("fit")
    assert data.cache_meta()["layers"] == [2, 4, 0]
    batch = next(iter(data.train_dataloader()))
    assert batch["embeds"].shape == (4, SEQ, 96) and batch["embeds"].dtype == torch.bfloat16


def test_train_windows_keeps_the_first_training_rows_and_the_same_validation_rows(caches):
    from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    d, _ = caches
    cache = d / "bfloat16"
    rows = read_cache_meta(cache)["windows"]                    # 12: 8 to train on, 4 held out
    every = cache_rows(open_cache(cache), np.arange(rows), read_cache_meta(cache))["tokens"]
    full = HFEmbeddingsDataModule(cache=str(cache), seq_len=SEQ, batch_size=4, val_windows=4)
    part = HFEmbeddingsDataModule(cache=str(cache), seq_len=SEQ, batch_size=4, val_windows=4, train_windows=3)
    assert (full.train_rows, part.train_rows) == (8, 3)
    assert torch.equal(part.validation_batch()["tokens"], full.validation_batch()["tokens"])
    assert torch.equal(part.validation_batch()["tokens"], every[8:])
    seen = {tuple(r) for batch, _ in zip(part.train_dataloader(), range(6), strict=False)
            for r in batch["tokens"].tolist()}
    assert seen == {tuple(r) for r in every[:3].tolist()}      # 24 draws of rows 0..2, each pass a permutation
    with pytest.raises(SpecdecError, match=r"data.train_windows \(9\) exceeds the 8 training rows") as error:
        HFEmbeddingsDataModule(cache=str(cache), seq_len=SEQ, val_windows=4, train_windows=9).cache_meta()
    assert "\n" not in str(error.value)
    with pytest.raises(SpecdecError, match="data.train_windows"):
        HFEmbeddingsDataModule(cache=str(cache), seq_len=SEQ, train_windows=0)


def test_extra_caches_add_all_their_rows_to_training_and_none_to_validation(hf, caches, tmp_path):
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    d, _ = caches
    main, extra = d / "bfloat16", tmp_path / "extra"
    hf_cache(hf["deep"], extra, text=[str(hf["corpus"])], layers=[2, -1, 0], **{**COMMON, "seed": 2,
                                                                                      "windows": 5})
    tokens = {c: cache_rows(open_cache(c), np.arange(n), read_cache_meta(c))["tokens"] for c, n in [(main, 12),
                                                                                                    (extra, 5)]}
    data = HFEmbeddingsDataModule(cache=str(main), seq_len=SEQ, batch_size=4, val_windows=4, extra_caches=[str(extra)])
    data.setup("fit")
    assert data.train_rows == 8 + 5
    assert torch.equal(data.validation_batch()["tokens"], tokens[main][8:])       # the main cache's last rows only
    loader = iter(data.train_dataloader())
    seen = [tuple(r) for _ in range(13) for r in next(loader)["tokens"].tolist()]      # 52 draws: 4 passes
    want = [tuple(r) for r in torch.cat([tokens[main][:8], tokens[extra]]).tolist()]
    for p in range(4):                                  # each pass over the 13 rows visits every one once
        assert sorted(seen[13 * p: 13 * (p + 1)]) == sorted(want)
    first = HFEmbeddingsDataModule(cache=str(main), seq_len=SEQ, batch_size=4, val_windows=4, train_windows=10,
                                   extra_caches=[str(extra)])
    drawn = {tuple(r) for batch, _ in zip(first.train_dataloader(), range(5), strict=False)
             for r in batch["tokens"].tolist()}
    assert drawn == set(want[:10])                      # the main cache's 8 training rows, then the extra's first 2


@pytest.mark.parametrize("change, message", [({"layers": [2, -1]}, "holds layers"),
                                             ({"dtype": "int8"}, "holds dtype int8"),
                                             ({"seq_len": 8}, "seq_len 8"),
                                             ({"kind": "regenerated"}, "holds regenerated rows"),
                                             ({"weights_sha256": "0" * 64}, "another target")])
def test_an_extra_cache_unlike_the_main_one_is_refused_in_one_line(hf, caches, tmp_path, change, message):
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    d, _ = caches
    extra = tmp_path / "extra"
    if "kind" in change or "weights_sha256" in change:     # what cache.json records of the rows and the target
        shutil.copytree(d / "bfloat16", extra)
        meta = json.loads((extra / "cache.json").read_text())
        meta["source"]["kind"] = change.get("kind", meta["source"]["kind"])
        meta["model"]["weights_sha256"] = change.get("weights_sha256", meta["model"]["weights_sha256"])
        (extra / "cache.json").write_text(json.dumps(meta))
    else:
        hf_cache(hf["deep"], extra, text=[str(hf["corpus"])], **{**COMMON, "windows": 4, "layers": [2, -1, 0],
                                                                      **change})
    data = HFEmbeddingsDataModule(cache=str(d / "bfloat16"), seq_len=SEQ, val_windows=4,
                                  extra_caches=[str(tmp_path / "extra")])
    with pytest.raises(SpecdecError, match=message) as error:
        data.cache_meta()
    assert "\n" not in str(error.value)
    with pytest.raises(SpecdecError, match="must be a list"):
        HFEmbeddingsDataModule(cache=str(d / "bfloat16"), seq_len=SEQ, extra_caches=str(tmp_path / "extra"))


# ---------------------------------------------------------------- refusals

def test_a_cache_lacking_a_layer_the_head_needs_is_refused_in_one_line(caches):
    d, _ = caches
    assert check_cache(d / "bfloat16", layers=[0, 2, -1])["layers"] == [2, 4, 0]
    assert check_cache(d / "default", layers=[-1])["layers"] == [DEPTH]
    with pytest.raises(SpecdecError) as error:
        check_cache(d / "default", layers=[2, -1, 1])
    message = str(error.value)
    assert f"{d / 'default'} holds layers [4]; the head needs [2, 4, 1]: rebuild it with --layers 2,4,1" in message
    assert "\n" not in message
    with pytest.raises(SpecdecError, match="out of range"):
        check_cache(d / "default", layers=[5])


@pytest.mark.parametrize("layers, message", [([5], "out of range: a model of 4 layers has hidden states 0..4"),
                                             ([1, -4], "name a hidden state twice"),
                                             ([], "at least one"),
                                             (["1"], "must be integers")])
def test_bad_layers_are_refused_in_one_line_before_any_work(hf, tmp_path, layers, message):
    with pytest.raises(SpecdecError, match=message) as error:
        hf_cache(hf["deep"], tmp_path / "c", text=[str(hf["corpus"])], layers=layers, **COMMON)
    assert "\n" not in str(error.value) and not list(tmp_path.iterdir())


def test_the_script_takes_layers_for_a_target_only(hf, tmp_path, capsys):
    from conftest import command

    script = command("cache_embeddings")
    out = tmp_path / "c"
    argv = ["--export", str(tmp_path), "--data", str(hf["corpus"]), "--layers", "1", "--out", str(out)]
    assert script.main(argv) == 2
    assert "--layers" in capsys.readouterr().err and not out.exists()
    assert script.main(["--hf-model", str(hf["deep"]), "--text", str(hf["corpus"]), "--layers", "1,-1",
                        "--out", str(out), "--seq-len", "8", "--windows", "4"]) == 0
    assert json.loads((out / "cache.json").read_text())["layers"] == [1, 4]
    capsys.readouterr()


def test_hf_prophet_trains_from_a_cache_of_several_layers_reading_the_last(hf, caches, tmp_path):
    # a cache made for an eagle3 head (aux layers and the last) serves a prophet head too: it reads
    # the last layer's slice of each row, the same values a one-layer cache of those rows holds
    from test_hf_prophet_task import cfg

    from train.data.hf_embeddings import HFEmbeddingsDataModule
    from train.run import run
    from train.tasks.hf_prophet import HFProphetModule

    d, _ = caches
    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={d / 'bfloat16'}", f"data.seq_len={SEQ}",
                     "trainer.max_steps=2", target="deep"))
    assert result["global_step"] == 2
    module = HFProphetModule.load_from_checkpoint(result["last_ckpt"], weights_only=False)
    assert module.hparams.cache_layers == [2, 4, 0]
    batch = HFEmbeddingsDataModule(cache=str(d / "bfloat16"), seq_len=SEQ, val_windows=2).validation_batch()
    tokens, hidden, valid = module._inputs(batch)
    torch.testing.assert_close(hidden, batch["embeds"].unflatten(-1, (3, -1))[..., 1, :])
    assert valid is None                                       # text windows: every token is real


def test_a_format_3_cache_reads_as_its_last_layer(caches, tmp_path):
    d, _ = caches
    old = tmp_path / "v3"
    shutil.copytree(d / "default", old)
    meta = json.loads((old / "cache.json").read_text())
    meta["format_version"] = 3
    del meta["layers"], meta["depth"]
    (old / "cache.json").write_text(json.dumps(meta))
    found = check_cache(old, layers=[-1])
    assert (found["layers"], found["depth"]) == ([DEPTH], DEPTH)
    rows = cache_rows(open_cache(old, found), np.arange(3), found)
    assert torch.equal(rows["embeds"], cache_rows(open_cache(d / "default"), np.arange(3),
                                                  read_cache_meta(d / "default"))["embeds"])
    meta["model"]["path"] = str(tmp_path / "gone")
    (old / "cache.json").write_text(json.dumps(meta))
    with pytest.raises(SpecdecError, match="format 3.*cannot be read.*rebuild it"):
        read_cache_meta(old)


# ---------------------------------------------------------------- regenerated rows stop at EOS

LONG = 32                    # prompts take up to 15 tokens
REGENERATED = dict(COMMON, seq_len=LONG, prompts=None, chat=True, temperatures=[0.0, 1.0], layers=[1, -1], dtype="int8")


@pytest.fixture(scope="module")
def regenerated(hf):
    path = hf["root"] / "regenerated"
    return path, hf_cache(hf["eager"], path, **{**REGENERATED, "prompts": hf["prompts"]})


def test_regenerated_rows_end_at_the_stop_token_padded_after_it_with_their_valid_len(hf, regenerated):
    path, meta = regenerated
    eos = hf["tok"].eos_token_id
    assert meta["source"]["eos_id"] == eos and meta["layers"] == [1, DEPTH]
    rows = cache_rows(open_cache(path, meta), np.arange(12), meta)
    valid, prompt_len = rows["valid_len"], rows["prompt_len"]
    model = load_causal_lm(hf["eager"])
    stopped = 0
    for i in range(0, 12, 2):                                 # temperature 0: the target's greedy answer
        n = int(prompt_len[i])
        expected = model.generate(rows["tokens"][i, None, :n], attention_mask=torch.ones(1, n, dtype=torch.long),
                                  max_new_tokens=LONG + 1 - n, do_sample=False, pad_token_id=eos,
                                  eos_token_id=eos)[0, : LONG + 1].tolist()
        assert rows["tokens"][i].tolist() == expected + [eos] * (LONG + 1 - len(expected))
        assert int(valid[i]) == len(expected)
        stopped += len(expected) < LONG + 1
    assert stopped >= 2                                          # the test sees rows that stop
    for i in range(12):                                          # every row: cut right after its first stop
        answer = rows["tokens"][i, int(prompt_len[i]):int(valid[i])].tolist()
        assert eos not in answer[:-1] and (int(valid[i]) == LONG + 1 or answer[-1] == eos)
    # the hidden states of the real tokens are the teacher-forced ones, at both layers
    states = hidden_states(hf["eager"], rows["tokens"][:, :-1])
    for k, layer in enumerate(meta["layers"]):
        for i in range(12):
            m = int(valid[i]) - 1                                   # positions whose hidden state is read
            online = states[layer][i, :m]
            error = (rows["embeds"][i, :m, 32 * k: 32 * (k + 1)] - online).abs() / online.abs().amax(-1, keepdim=True)
            assert error.max() <= 0.5 / 127 + 1e-6


def assert_an_interrupted_build_resumes(target, out, expected, stop_after_tokens, **kwargs):
    """build_hf_cache of `target` into `out`, killed (KeyboardInterrupt) once it has read
    `stop_after_tokens`, leaves no cache but its finished shards in `out`.partial; built again, it
    reuses them ("already written") and ends with the rows of the uninterrupted cache `expected`."""
    done = []

    def interrupt(tokens):                 # stops the build after its first shard, as a kill would
        done.append(tokens)
        if sum(done) > stop_after_tokens:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hf_cache(target, out, progress=interrupt, **kwargs)
    assert not out.exists() and list((out.parent / f"{out.name}.partial" / "dataset").glob("data-*.arrow"))
    lines = []
    hf_cache(target, out, report=lines.append, **kwargs)
    assert any("already written" in line for line in lines)
    assert open_cache(out)[:].equals(open_cache(expected)[:])


def test_an_interrupted_several_layer_cache_resumes_to_the_uninterrupted_rows(hf, regenerated, tmp_path):
    path, _ = regenerated
    assert_an_interrupted_build_resumes(hf["eager"], tmp_path / "regenerated", path, 4 * LONG,
                                        **{**REGENERATED, "prompts": hf["prompts"]})


@pytest.mark.parametrize("budget, whole, last", [(20.5, 8, 0), (25.0, 8, 1), (17.0, 4, 2)])
def test_a_time_budget_keeps_the_first_rows_of_the_full_build(hf, regenerated, tmp_path, monkeypatch, budget, whole,
                                                              last):
    # the writer's clock moves 10 s per batch written, so 20 s pass in two batches (a batch is 4 rows
    # or a shard's, whichever is fewer). A third whole batch would end at 30 s. With 20.5 s it does not
    # start, and 0.5 s fit no row; with 25 s it starts smaller: the rows that should end within the 5 s
    # left at the last batch's 2.5 s a row, less a tenth (1.8: one row); with 17 s, after one batch,
    # 0.9 x 7 / 2.5 = 2.5 rows fit: 2. The cache holds the first rows, those of the full build, its
    # smaller last batch rows of the same prompts
    import train.data.embeddings_cache as writer

    path, _ = regenerated
    clock = [0.0]
    monkeypatch.setattr(writer, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    lines = []
    meta = hf_cache(hf["eager"], tmp_path / "budget", **{**REGENERATED, "prompts": hf["prompts"]},
                          progress=lambda tokens: clock.__setitem__(0, clock[0] + 10.0), report=lines.append,
                          max_seconds=budget)
    assert min(4, meta["rows_per_shard"]) == 4 and meta["batch_size"] == 4
    rows = whole + last
    assert (meta["windows"], meta["requested_windows"], meta["tokens"]) == (rows, 12, rows * LONG) and rows < 12
    assert any(f"ran out after {rows} of 12 rows" in line for line in lines)
    assert check_cache(tmp_path / "budget")["windows"] == rows and not (tmp_path / "budget.partial").exists()
    got, full = open_cache(tmp_path / "budget")[:], open_cache(path)[:rows]
    assert got[:whole].equals(full[:whole])
    for column in ("offset", "prompt_len"):                  # the smaller batch: the same prompts
        assert got[column].to_pylist() == full[column].to_pylist()


def test_a_last_batch_takes_the_rows_that_should_fit():
    from train.data.embeddings_cache import last_batch_rows

    assert last_batch_rows(60.0, 120.0, 256, 256) == 115                 # 0.9 x 60 / 120 x 256 = 115.2
    assert last_batch_rows(500.0, 120.0, 256, 256) == 256                # never more than a batch
    assert last_batch_rows(8.0, 120.0, 256, 256) == 0                    # 15.4 rows: under an eighth of 256
    assert last_batch_rows(-1.0, 120.0, 256, 256) == 0                   # the budget already spent
    assert last_batch_rows(60.0, 0.0, 0, 256) == 0                       # no batch timed yet


def test_a_cache_can_leave_out_the_prompts_an_earlier_cache_continued(hf, tmp_path):
    # the first cache continues 4 of the 8 prompts; the second, told to leave those out, continues
    # only the other 4 (its 12 rows cycle over them), and records what it left out
    settings = {**REGENERATED, "prompts": hf["prompts"]}
    hf_cache(hf["eager"], tmp_path / "first", **{**settings, "windows": 4})
    first = continued_prompts(tmp_path / "first")
    lines = []
    meta = hf_cache(hf["eager"], tmp_path / "second", **settings, exclude_prompts_of=[tmp_path / "first"],
                          report=lines.append)
    second = continued_prompts(tmp_path / "second")
    assert len(first) == 4 and len(second) == 4 and not first & second
    assert meta["source"]["left_out"] == {"caches": [str((tmp_path / "first").resolve())], "prompts": 4}
    assert meta["source"]["prompt_count"] == 4
    assert any(line.startswith("left out 4 of the 8 prompts: continued by ") for line in lines)


def test_an_extra_cache_of_fresh_answers_trains_and_one_continuing_a_held_out_prompt_is_refused(hf, tmp_path):
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    settings = {**REGENERATED, "prompts": hf["prompts"]}
    hf_cache(hf["eager"], tmp_path / "first", **{**settings, "windows": 4})
    hf_cache(hf["eager"], tmp_path / "fresh", **settings, exclude_prompts_of=[tmp_path / "first"])
    hf_cache(hf["eager"], tmp_path / "again", **{**settings, "windows": 4})      # the same 4 prompts again
    common = {"cache": str(tmp_path / "first"), "seq_len": LONG, "batch_size": 2, "val_windows": 2}
    data = HFEmbeddingsDataModule(**common, extra_caches=[str(tmp_path / "fresh")])
    assert data.train_rows == 2 + 12
    assert set(next(iter(data.train_dataloader()))) == {"tokens", "embeds", "prompt_len", "valid_len"}
    with pytest.raises(SpecdecError, match=r"again continues 2 of the prompts of the 2 validation rows of .*first: "
                                           r"rebuild it with --exclude-prompts-of") as error:
        HFEmbeddingsDataModule(**common, extra_caches=[str(tmp_path / "again")]).cache_meta()
    assert "\n" not in str(error.value)


def test_leaving_out_prompts_needs_a_regenerated_cache_and_prompts(hf, caches, tmp_path, capsys):
    d, _ = caches
    with pytest.raises(SpecdecError, match="holds no continuations of prompts .*'text_windows'.*built with --prompts"):
        hf_cache(hf["eager"], tmp_path / "a", **{**REGENERATED, "prompts": hf["prompts"]},
                       exclude_prompts_of=[d / "default"])
    with pytest.raises(SpecdecError, match="does not exist"):
        hf_cache(hf["eager"], tmp_path / "b", **{**REGENERATED, "prompts": hf["prompts"]},
                       exclude_prompts_of=[tmp_path / "missing"])
    status = command("cache_embeddings").main(["--hf-model", str(hf["eager"]), "--text", str(hf["corpus"]),
                                                   "--exclude-prompts-of", str(d / "default"),
                                                   "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert status == 2 and err == "error: --exclude-prompts-of leaves out prompts: give --prompts\n"
    assert not any(tmp_path.iterdir())


def test_the_scripts_time_budget_must_be_positive(hf, tmp_path, capsys):
    status = command("cache_embeddings").main(["--hf-model", str(hf["eager"]), "--text", str(hf["corpus"]),
                                                   "--out", str(tmp_path / "c"), "--max-minutes", "0"])
    err = capsys.readouterr().err
    assert status == 2 and err == "error: --max-minutes must be > 0, got 0.0\n" and not (tmp_path / "c").exists()


def test_the_stop_token_is_the_chat_templates_end_of_turn(tmp_path):
    template = ("{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eot> {% endfor %}"
                "{% if add_generation_prompt %}<bos> assistant {% endif %}")
    tok = build_tokenizer(tmp_path / "tok", extra=("<eot>",), chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": ["<eot>"]})
    eot = tok.convert_tokens_to_ids("<eot>")
    assert eot != tok.eos_token_id
    assert stop_token(tok, chat=True) == eot and stop_token(tok, chat=False) == tok.eos_token_id
    assert stop_token(build_tokenizer(tmp_path / "plain"), chat=True) == tok.eos_token_id
