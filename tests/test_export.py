"""The export format: exact round trips (logits and weight layout), atomic replacement under a
simulated crash, no pickle on load, and a one-line SpecdecError for each kind of bad directory."""

import json
import os

import pytest
import torch

import specdec_models.export.specdec as export_mod
from specdec_models import (
    Decoder,
    ModelConfig,
    ModelWithProphet,
    ProphetConfig,
    SpecdecError,
    export_hash,
    load_export,
    save_export,
)

V = 64


def tiny_decoder(seed=0, vocab=V):
    torch.manual_seed(seed)
    return Decoder(ModelConfig(vocab_size=vocab, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=64)).eval()


def tiny_with_prophet(seed=0, prophet_dim=16):
    torch.manual_seed(seed)
    main = ModelConfig(vocab_size=V, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=64)
    prophet = ProphetConfig(model=ModelConfig(vocab_size=V, dim=prophet_dim, depth=1, heads=1, dim_head=16,
                                              max_seq_len=32),
                            prophet_train_length=4, num_leading_start_tokens=2)
    return ModelWithProphet(main, prophet).eval()


def tokens(b=2, n=12):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(1))


def assert_same_weights_and_layout(a: torch.nn.Module, b: torch.nn.Module):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
        assert pa[name].stride() == pb[name].stride(), name
        assert pa[name].dtype == pb[name].dtype, name


def expect_error(match, fn, *args, **kwargs):
    with pytest.raises(SpecdecError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- round trips

def test_decoder_round_trip_gives_identical_logits_and_column_major_strides(tmp_path):
    model = tiny_decoder()
    # the layout the decoder keeps on purpose must exist, or this test checks nothing
    assert any(not p.is_contiguous() for p in model.parameters())
    save_export(tmp_path / "exp", model, metadata={"run": "unit", "step": 3})
    loaded = load_export(tmp_path / "exp")
    assert type(loaded) is Decoder and loaded.cfg == model.cfg and not loaded.training
    assert_same_weights_and_layout(model, loaded)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["kind"] == "decoder" and config["prophet"] is None
    assert config["format"] == "specdec-export" and config["format_version"] == 1
    assert config["tokenizer"] == {"kind": "bytes"} and config["metadata"] == {"run": "unit", "step": 3}


@pytest.mark.parametrize("prophet_dim", [16, 32])     # a linear start projection, and the identity
def test_model_with_prophet_round_trip_gives_identical_main_and_prophet_logits(tmp_path, prophet_dim):
    model = tiny_with_prophet(prophet_dim=prophet_dim)
    save_export(tmp_path, model)
    loaded = load_export(tmp_path)
    assert type(loaded) is ModelWithProphet
    assert loaded.main_cfg == model.main_cfg and loaded.prophet_cfg == model.prophet_cfg
    assert_same_weights_and_layout(model, loaded)
    x = tokens()
    with torch.no_grad():
        ref, got = model.model(x), loaded.model(x)
        assert torch.equal(got.logits, ref.logits)
        start = model.start_tokens(ref.embeds[:, -2:])
        assert torch.equal(loaded.start_tokens(ref.embeds[:, -2:]), start)
        assert torch.equal(loaded.prophet(x[:, :3], start=start).logits, model.prophet(x[:, :3], start=start).logits)
        assert torch.equal(loaded(x).loss, model(x).loss)


def test_bf16_export_loads_back_in_bf16(tmp_path):
    model = tiny_decoder().to(torch.bfloat16)
    save_export(tmp_path, model)
    loaded = load_export(tmp_path)
    assert_same_weights_and_layout(model, loaded)


def test_export_hash_is_the_weights_sha256_and_changes_with_the_weights(tmp_path):
    import hashlib

    save_export(tmp_path / "a", tiny_decoder(seed=0))
    save_export(tmp_path / "b", tiny_decoder(seed=0))
    save_export(tmp_path / "c", tiny_decoder(seed=1))
    h = export_hash(tmp_path / "a", verify=True)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    file_hash = hashlib.sha256((tmp_path / "a" / config["weights"]).read_bytes()).hexdigest()
    assert h == config["weights_sha256"] == file_hash
    assert config["weights"] == f"weights-{h[:16]}.safetensors"
    assert export_hash(tmp_path / "b") == h          # same weights, same identity
    assert export_hash(tmp_path / "c") != h


def test_loading_uses_no_pickle(tmp_path, monkeypatch):
    save_export(tmp_path, tiny_with_prophet())

    def forbidden(*args, **kwargs):
        raise AssertionError("load_export must not unpickle anything")

    import pickle
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    assert isinstance(load_export(tmp_path), ModelWithProphet)


# ---------------------------------------------------------------- atomic replacement

def _crash_on(monkeypatch, name_part):
    """Make os.replace raise when its destination name contains `name_part` (a crash mid-save)."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if name_part in os.fspath(dst):
            raise OSError("simulated crash")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(export_mod.os, "replace", replace)


@pytest.mark.parametrize("crash_at", ["config.json", "weights-"])
def test_crash_while_replacing_an_export_leaves_the_old_one_loadable(tmp_path, monkeypatch, crash_at):
    old, new = tiny_decoder(seed=0), tiny_decoder(seed=1)
    save_export(tmp_path, old)
    old_hash = export_hash(tmp_path)
    _crash_on(monkeypatch, crash_at)
    expect_error("cannot write the export.*simulated crash", save_export, tmp_path, new)
    monkeypatch.undo()
    loaded = load_export(tmp_path)
    assert export_hash(tmp_path, verify=True) == old_hash
    assert_same_weights_and_layout(old, loaded)
    # no half-written temp files are left behind by the failed save
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # the next successful save commits the new weights and removes the orphaned file
    save_export(tmp_path, new)
    assert_same_weights_and_layout(new, load_export(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", f"weights-{export_hash(tmp_path)[:16]}.safetensors"]


def test_crash_while_writing_the_config_json_leaves_the_old_export_loadable(tmp_path, monkeypatch):
    old = tiny_with_prophet(seed=0)
    save_export(tmp_path, old)

    def broken_write(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "write_file", broken_write)
    expect_error("cannot write the export.*No space left", save_export, tmp_path, tiny_with_prophet(seed=1))
    monkeypatch.undo()
    assert_same_weights_and_layout(old, load_export(tmp_path))


def test_leftovers_of_a_killed_save_are_removed_by_the_next_save(tmp_path):
    save_export(tmp_path, tiny_decoder(seed=0))
    (tmp_path / ".tmp-weights-dead.safetensors").write_bytes(b"half")
    (tmp_path / ".tmpAb12Cd").write_bytes(b"safetensors' own temp file")
    (tmp_path / ".tmp-weights-999999999-0123abcd").mkdir()      # a temp dir of a process that is gone
    (tmp_path / "weights-0123456789abcdef.safetensors").write_bytes(b"orphan")
    (tmp_path / "notes.txt").write_text("the user's own file stays")
    save_export(tmp_path, tiny_decoder(seed=1))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "notes.txt", f"weights-{export_hash(tmp_path)[:16]}.safetensors"]


def test_save_refuses_to_overwrite_a_foreign_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    expect_error("not a specdec export.*--force", save_export, tmp_path, tiny_decoder())
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "gpt2"}


# ---------------------------------------------------------------- overwriting, file modes, permissions

def test_save_refuses_a_folder_that_is_not_an_export_unless_forced(tmp_path):
    cache = tmp_path / "cache"                       # an embeddings cache, say
    (cache / "dataset").mkdir(parents=True)
    (cache / "cache.json").write_text("{}")
    message = expect_error("not a specdec export .it holds cache.json, dataset.*--force", save_export, cache,
                           tiny_decoder())
    assert str(cache) in message
    assert sorted(p.name for p in cache.iterdir()) == ["cache.json", "dataset"]
    save_export(cache, tiny_decoder(), force=True)
    assert_same_weights_and_layout(tiny_decoder(), load_export(cache))
    assert (cache / "cache.json").is_file()          # force writes into the folder, it does not empty it


@pytest.mark.parametrize("other", ["kind", "size"])
def test_save_refuses_to_replace_an_export_of_another_model_unless_forced(tmp_path, other):
    save_export(tmp_path, tiny_with_prophet(), metadata={"global_step": 500})
    before = export_hash(tmp_path)
    new = tiny_decoder() if other == "kind" else tiny_with_prophet(prophet_dim=32)
    changed = "kind, prophet" if other == "kind" else "prophet"
    message = expect_error(f"holds a model_with_prophet export of step 500 .weights {before[:16]}., another model "
                           f".its {changed} differ.*--force", save_export, tmp_path, new)
    assert "choose another export directory" in message
    assert export_hash(tmp_path, verify=True) == before
    assert export_mod.check_export_target(tmp_path, new, force=True)["weights_sha256"] == before
    save_export(tmp_path, new, force=True)
    assert_same_weights_and_layout(new, load_export(tmp_path))


def test_the_same_model_with_new_weights_replaces_the_export_and_says_which(tmp_path):
    save_export(tmp_path, tiny_decoder(seed=0), metadata={"global_step": 10})
    old = export_mod.check_export_target(tmp_path, tiny_decoder(seed=1))
    assert export_mod.describe_export(old) == f"a decoder export of step 10 (weights {old['weights_sha256'][:16]})"
    save_export(tmp_path, tiny_decoder(seed=1))
    assert_same_weights_and_layout(tiny_decoder(seed=1), load_export(tmp_path))
    assert export_mod.check_export_target(tmp_path / "new", tiny_decoder()) is None


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_export_files_get_the_umask_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_export(tmp_path, tiny_decoder())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes     # safetensors alone would give the weights 0600


def test_save_into_a_read_only_folder_is_one_line(shared_dir):
    from conftest import NOBODY, forked

    target = shared_dir / "readonly" / "export"
    child = forked(lambda: save_export(target, tiny_decoder()), user=NOBODY)
    assert child.status == 71 and "SpecdecError" in child.output, child.output
    line = child.output.strip().splitlines()[-1]
    assert line.startswith("specdec_models.errors.SpecdecError: export directory") and "is not writable" in line
    assert not target.exists()


def test_save_rejects_bad_arguments(tmp_path):
    expect_error("Decoder or a ModelWithProphet", save_export, tmp_path, torch.nn.Linear(2, 2))
    expect_error("tokenizer", save_export, tmp_path, tiny_decoder(), tokenizer="gpt2")
    expect_error("plain JSON", save_export, tmp_path, tiny_decoder(), metadata={"when": object()})
    (tmp_path / "file").write_text("x")
    expect_error("not a directory", save_export, tmp_path / "file", tiny_decoder())


# ---------------------------------------------------------------- bad directories

@pytest.fixture
def exported(tmp_path):
    directory = tmp_path / "exp"
    save_export(directory, tiny_decoder())
    return directory


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return config


def test_missing_directory_is_a_clear_error(tmp_path):
    message = expect_error("does not exist", load_export, tmp_path / "nope")
    assert str(tmp_path / "nope") in message
    expect_error("does not exist", export_hash, tmp_path / "nope")


def test_missing_config_json_is_a_clear_error(exported):
    (exported / "config.json").unlink()
    expect_error("config.json is missing.*not a specdec export", load_export, exported)


@pytest.mark.parametrize("text", ['{"format": "specdec-export", ', "", "\x00\xff"])
def test_invalid_config_json_is_a_clear_error(exported, text):
    (exported / "config.json").write_text(text, encoding="latin-1")
    expect_error("not valid JSON.*re-export", load_export, exported)


def test_config_json_that_is_not_an_object_is_a_clear_error(exported):
    (exported / "config.json").write_text("[1, 2]")
    expect_error("JSON object", load_export, exported)


def test_unknown_format_is_a_clear_error(exported):
    _edit_config(exported, format="hf-transformers")
    expect_error("format 'hf-transformers'.*not a specdec export", load_export, exported)


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_unknown_format_version_is_a_clear_error(exported, version):
    _edit_config(exported, format_version=version)
    expect_error("format_version.*reads version 1", load_export, exported)


def test_unknown_kind_and_inconsistent_prophet_are_clear_errors(exported):
    _edit_config(exported, kind="encoder")
    expect_error("kind 'encoder'", load_export, exported)
    _edit_config(exported, kind="model_with_prophet")
    expect_error("must have a prophet config", load_export, exported)


def test_unknown_tokenizer_is_a_clear_error(exported):
    _edit_config(exported, tokenizer={"kind": "sentencepiece"})
    expect_error("tokenizer", load_export, exported)


def test_bad_model_config_is_a_clear_error(exported):
    config = json.loads((exported / "config.json").read_text())
    _edit_config(exported, main={**config["main"], "n_layers": 3})
    expect_error("bad model config.*n_layers", load_export, exported)


@pytest.mark.parametrize("part,key", [("main", "max_seq_len"), ("prophet", "prophet_train_length"),
                                      ("prophet", "num_leading_start_tokens")])
def test_an_edited_model_config_is_refused_on_load(tmp_path, part, key):
    """config.json is covered by the export's hashes: a larger max_seq_len or prophet_train_length
    written into it by hand would let decoding run past what the model was trained for."""
    save_export(tmp_path / "p", tiny_with_prophet(), metadata={"gamma": 5})
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    _edit_config(tmp_path / "p", metadata={"gamma": 3})                 # run metadata: not the model
    load_export(tmp_path / "p")
    _edit_config(tmp_path / "p", **{part: {**config[part], key: config[part][key] + 1}})
    message = expect_error("does not match the model_with_prophet config in", load_export, tmp_path / "p")
    assert str(tmp_path / "p" / "config.json") in message and "was config.json edited?" in message
    expect_error("was config.json edited", export_hash, tmp_path / "p", verify=True)
    _edit_config(tmp_path / "p", **{part: config[part]})                  # restored: loads again
    load_export(tmp_path / "p")


def test_weights_name_outside_the_directory_is_refused(exported):
    _edit_config(exported, weights="../elsewhere.safetensors")
    expect_error("file name inside the export directory", load_export, exported)


def test_missing_weights_file_is_a_clear_error(exported):
    config = json.loads((exported / "config.json").read_text())
    (exported / config["weights"]).unlink()
    expect_error("is missing.*re-export", load_export, exported)
    expect_error("is missing", export_hash, exported, verify=True)


def test_truncated_weights_file_is_a_clear_error(exported):
    config = json.loads((exported / "config.json").read_text())
    weights = exported / config["weights"]
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    expect_error("truncated or corrupt", load_export, exported)
    expect_error("truncated or corrupt", export_hash, exported, verify=True)
    assert export_hash(exported) == config["weights_sha256"]       # the recorded identity, unverified


def test_sha_mismatch_is_a_clear_error(exported):
    config = json.loads((exported / "config.json").read_text())
    weights = exported / config["weights"]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                      # same size, one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    expect_error("sha256.*truncated or corrupt", load_export, exported)


def _replace_weights(directory, tensors):
    """Swap in other tensors and record their hash, as a buggy writer would."""
    import hashlib

    from safetensors.torch import save_file

    config = json.loads((directory / "config.json").read_text())
    path = directory / config["weights"]
    save_file(tensors, str(path))
    _edit_config(directory, weights_sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_unreadable_safetensors_with_a_matching_hash_is_a_clear_error(exported):
    import hashlib

    config = json.loads((exported / "config.json").read_text())
    path = exported / config["weights"]
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    _edit_config(exported, weights_sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    expect_error("cannot read weights file", load_export, exported)


def test_missing_and_unexpected_tensors_are_clear_errors(exported):
    tensors = {k: v.contiguous() for k, v in tiny_decoder().state_dict().items()}
    del tensors["norm.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    _replace_weights(exported, tensors)
    message = expect_error("does not match", load_export, exported)
    assert "missing tensors norm.weight" in message and "unexpected tensors extra.weight" in message


def test_tensor_of_the_wrong_shape_is_a_clear_error(exported):
    tensors = {k: v.contiguous() for k, v in tiny_decoder(vocab=V + 1).state_dict().items()}
    _replace_weights(exported, tensors)
    expect_error("does not match the config", load_export, exported)


def test_decoder_weights_under_a_prophet_config_are_a_clear_error(tmp_path):
    save_export(tmp_path / "p", tiny_with_prophet())
    save_export(tmp_path / "d", tiny_decoder())
    decoder_config = json.loads((tmp_path / "d" / "config.json").read_text())
    prophet_config = json.loads((tmp_path / "p" / "config.json").read_text())
    (tmp_path / "p" / prophet_config["weights"]).unlink()
    (tmp_path / "d" / decoder_config["weights"]).rename(tmp_path / "p" / decoder_config["weights"])
    _edit_config(tmp_path / "p", weights=decoder_config["weights"], weights_sha256=decoder_config["weights_sha256"])
    expect_error("does not match the model_with_prophet config", load_export, tmp_path / "p")
