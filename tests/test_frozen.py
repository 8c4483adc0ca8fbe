"""task=prophet_frozen: a prophet trains on a frozen main model read from an export. The main
model's weights stay bit-identical, get no gradient and stay in eval mode; the prophet (and its
start projection) learn; online and cached embeddings train end to end through run(cfg); the
export is a model_with_prophet that decodes; bad input stops a run in one line before any work."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from conftest import StopAt, command

import train.run as train_run
from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, load_export, save_export
from specdec_models.errors import SpecdecError
from specdec_models.export import export_hash, read_export_config
from train.checkpoints import export_checkpoint
from train.data.embeddings_cache import CacheSettings, build_cache
from train.run import run, validate
from train.tasks.prophet_frozen import FrozenProphetModule

pytestmark = [pytest.mark.usefixtures("offline", "one_thread"),
              # Lightning's notice about modules in eval mode at fit start: the frozen main model, on purpose
              pytest.mark.filterwarnings("ignore:Found .* module\\(s\\) in eval mode")]

MAIN = ModelConfig(dim=32, depth=2, heads=2, dim_head=16, max_seq_len=512)



@pytest.fixture(scope="module")
def main_export(tmp_path_factory):
    """A tiny main model (a decoder export) to freeze."""
    torch.manual_seed(0)
    return save_export(tmp_path_factory.mktemp("main") / "export", Decoder(MAIN))


def frozen_cfg(compose, tiny_corpus, out, export, *extra):
    overrides = ["experiment=tiny_prophet_frozen", f"main.export={export}", f"data.path={tiny_corpus}",
                 "data.allow_short=true", f"output_dir={out}", "trainer.enable_progress_bar=false"]
    return compose(overrides + list(extra))


class Watch(L.Callback):
    """Records, at every training step: the main model's gradients and modes, the prophet's
    gradients and modes; and the weights before the first step and after the last."""

    def __init__(self) -> None:
        self.main_grads, self.prophet_grads, self.main_training, self.prophet_training = [], [], [], []

    def on_train_start(self, trainer, module) -> None:
        self.before = {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.main_grads.append([p.grad is not None or p.requires_grad for p in module.net.model.parameters()])
        self.prophet_grads.append([p.grad is not None for p in module.net.prophet.parameters()])
        self.main_training.append({m.training for m in module.net.model.modules()})
        self.prophet_training.append({m.training for m in module.net.prophet.modules()})

    def on_train_end(self, trainer, module) -> None:
        self.after = {k: v.detach().clone() for k, v in module.net.state_dict().items()}


@pytest.fixture(scope="module")
def online(compose, tiny_corpus, main_export, tmp_path_factory):
    """experiment=tiny_prophet_frozen, embeddings online: 40 steps, validation at 20 and 40."""
    watch = Watch()
    build = train_run.build_callbacks
    train_run.build_callbacks = lambda cfg: build(cfg) + [watch]
    try:
        result = run(frozen_cfg(compose, tiny_corpus, tmp_path_factory.mktemp("online") / "run", main_export))
    finally:
        train_run.build_callbacks = build
    return result, watch


@pytest.fixture(scope="module")
def cache(tiny_corpus, main_export, tmp_path_factory):
    """An embeddings cache of the main model: 48 windows of 64 + 1 bytes, top-8 logits, several shards."""
    path = tmp_path_factory.mktemp("cache") / "cache"
    build_cache(main_export, tiny_corpus, path,
                CacheSettings(seq_len=64, windows=48, top_k_logits=8, shard_size="64KB"))
    return path


def main_tensors(export) -> dict[str, torch.Tensor]:
    config = read_export_config(export)
    return load_file(str(export / config["weights"]))


# ---------------------------------------------------------------- the main model stays frozen

def test_main_model_is_bit_identical_after_training_and_gets_no_gradient(online, main_export):
    result, watch = online
    assert result["global_step"] == 40 and len(watch.main_grads) == 40
    assert not any(any(step) for step in watch.main_grads)            # no .grad, requires_grad False
    assert all(all(step) for step in watch.prophet_grads)
    assert all(modes == {False} for modes in watch.main_training)     # eval mode at every step
    assert all(modes == {True} for modes in watch.prophet_training)
    original = main_tensors(main_export)
    state = torch.load(result["last_ckpt"], weights_only=True)["state_dict"]
    for name, tensor in original.items():
        assert torch.equal(watch.before[f"model.{name}"], tensor), name
        assert torch.equal(watch.after[f"model.{name}"], tensor), name
        assert torch.equal(state[f"net.model.{name}"], tensor), name


def test_the_prophet_learns_and_only_it_is_optimized(online):
    result, watch = online
    changed = [k for k in watch.before if k.startswith("prophet.") and not torch.equal(watch.before[k], watch.after[k])]
    assert len(changed) == len([p for p in watch.before if p.startswith("prophet.") and "rotary" not in p])
    metrics = result["metrics"]
    for key in ("train/loss", "train/prophet_loss", "val/prophet_loss", "val/main_loss", "val/bpc"):
        assert math.isfinite(metrics[key]), key
    assert metrics["train/loss"] == metrics["train/prophet_loss"]
    assert metrics["val/prophet_loss"] < 0.5 * math.log(256)           # four sentences are learnt fast
    assert metrics["val/bpc"] == pytest.approx(metrics["val/main_loss"] / math.log(2))
    # the simulated acceptance (teacher-forced windows) next to the real one, from the same validation
    accuracy = [metrics[f"val/teacher_forced_accuracy/pos{i}"] for i in range(1, 6)]
    assert metrics["val/simulated_tokens_per_call"] == pytest.approx(
        1 + sum(math.prod(accuracy[:k]) for k in range(1, 6)), rel=1e-6)
    assert 1 < metrics["val/simulated_tokens_per_call"] <= 6 and "val/tokens_per_call/t0" in metrics


def test_optimizer_holds_only_the_prophet_and_its_projection(main_export):
    prophet = ProphetConfig(model=ModelConfig(dim=16, depth=1, heads=1, dim_head=16, max_seq_len=64))
    module = FrozenProphetModule(main=MAIN.to_dict(), prophet=prophet.to_dict(), export=str(main_export),
                                 weights_sha256=export_hash(main_export))
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    optimizer = module.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert isinstance(module.net.to_prophet_start, torch.nn.Linear)    # widths differ: 32 -> 16
    expected = {id(p) for p in [*module.net.prophet.parameters(), *module.net.to_prophet_start.parameters()]}
    assert optimized == expected


def test_main_stays_in_eval_mode_when_lightning_switches_to_train(main_export):
    module = FrozenProphetModule(main=MAIN.to_dict(), prophet=ProphetConfig(model=MAIN).to_dict(),
                                 export=str(main_export), weights_sha256=export_hash(main_export))
    module.train()
    assert not any(m.training for m in module.net.model.modules())
    assert all(m.training for m in module.net.prophet.modules())


# ---------------------------------------------------------------- the export

def test_export_holds_the_frozen_main_and_the_prophet_and_decodes(online, main_export, capsys):
    from specdec_models.decode import GREEDY, HeadDrafter, generate
    from specdec_models.decode.__main__ import main as decode_main

    result, _ = online
    pair = load_export(result["export_dir"])
    assert isinstance(pair, ModelWithProphet)
    assert read_export_config(result["export_dir"])["kind"] == "model_with_prophet"
    for name, tensor in main_tensors(main_export).items():
        assert torch.equal(pair.model.state_dict()[name], tensor), name
    meta = read_export_config(result["export_dir"])["metadata"]
    assert meta["task"] == "prophet_frozen" and meta["main_weights_sha256"] == export_hash(main_export)
    prompts = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    spec, stats = generate(pair.model, prompts, 8, HeadDrafter(pair), sampling=GREEDY)
    base, _ = generate(pair.model, prompts, 8, sampling=GREEDY)
    assert all(torch.equal(a, b) for a, b in zip(spec, base, strict=True))        # greedy speculative decoding is exact
    assert stats.method == "prophet"
    assert decode_main(["--export", str(result["export_dir"]), "--method", "prophet", "--prompt", "the ",
                        "--max-new-tokens", "8"]) == 0
    capsys.readouterr()


def test_export_checkpoint_and_the_export_script_rebuild_this_task(online, tmp_path, capsys):
    result, _ = online
    ckpt = torch.load(result["last_ckpt"], weights_only=True)
    assert ckpt["specdec_task"] == "prophet_frozen"
    again = export_checkpoint(result["last_ckpt"], tmp_path / "again")
    a, b = load_export(again).state_dict(), load_export(result["export_dir"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    script = command("export")
    assert script.main([str(result["last_ckpt"]), str(tmp_path / "script")]) == 0
    assert isinstance(load_export(tmp_path / "script"), ModelWithProphet)
    capsys.readouterr()


# ---------------------------------------------------------------- cached embeddings

def test_cached_run_trains_and_validates_like_the_online_run(online, cache, compose, tiny_corpus, main_export,
                                                              tmp_path):
    result = run(frozen_cfg(compose, tiny_corpus, tmp_path / "run", main_export, "data=enwik8_embeddings",
                            f"data.cache={cache}", "trainer.max_steps=20", "trainer.val_check_interval=10"))
    assert result["global_step"] == 20
    metrics = result["metrics"]
    assert math.isfinite(metrics["val/prophet_loss"]) and metrics["val/prophet_loss"] < math.log(256)
    # validation runs the same frozen main model online on the same fixed windows in both modes
    assert metrics["val/bpc"] == pytest.approx(online[0]["metrics"]["val/bpc"], rel=1e-6)
    assert load_export(result["export_dir"]).model.state_dict().keys() == main_tensors(main_export).keys()



@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_resumed_cached_run_continues_the_same_stream(compose, tiny_corpus, main_export, cache, tmp_path,
                                                        monkeypatch):
    def cfg(out, *extra):
        return frozen_cfg(compose, tiny_corpus, tmp_path / out, main_export, "data=enwik8_embeddings",
                          f"data.cache={cache}", "trainer.max_steps=8", "trainer.val_check_interval=4",
                          "callbacks.speculative_eval=null", *extra)

    whole = run(cfg("whole"))
    build = train_run.build_callbacks
    monkeypatch.setattr(train_run, "build_callbacks", lambda c: build(c) + [StopAt(4)])
    first = run(cfg("first"))
    monkeypatch.setattr(train_run, "build_callbacks", build)
    resumed = run(cfg("resumed", f"ckpt_path={first['last_ckpt']}"))
    assert (first["global_step"], resumed["global_step"]) == (4, 8)
    a = torch.load(resumed["last_ckpt"], weights_only=True)["state_dict"]
    b = torch.load(whole["last_ckpt"], weights_only=True)["state_dict"]
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, msg=name)


# ---------------------------------------------------------------- distillation toward the main model

def frozen_module(export, **kwargs) -> FrozenProphetModule:
    prophet = ProphetConfig(model=ModelConfig(dim=32, depth=1, heads=2, dim_head=16, max_seq_len=64))
    module = FrozenProphetModule(main=MAIN.to_dict(), prophet=prophet.to_dict(), export=str(export),
                                 weights_sha256=export_hash(export), **kwargs)
    module.setup("fit")
    return module


def test_teacher_position_i_predicts_the_token_prophet_position_i_predicts(main_export):
    module = frozen_module(main_export, distill="fkl")
    seq = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    embeds = module.main_embeddings(seq)
    main_logits = module.net.model.logits(embeds)                                   # (b, n, vocab)
    anchors = module.net.anchors(32, 2)
    logits, labels = module.net.prophet_logits(seq, embeds, anchors)
    teacher = module._teacher_logits(anchors, main_logits, seq)
    L, W = module.net.prophet_cfg.prophet_train_length, anchors.shape[1]
    assert teacher.shape == logits.shape == (2 * W, L, 256)
    for b, w, i in [(0, 0, 0), (1, 3, 6), (1, W - 1, 2)]:
        t = int(anchors[b, w])
        assert torch.equal(teacher[b * W + w, i], main_logits[b, t + i])          # predicts seq[t + i + 1]
        assert labels[b * W + w, i] == seq[b, t + i + 1]
    # the prophet's loss is the data's next-token loss; distillation changes the training loss only
    loss, parts = module._losses(seq, embeds, 0, main_logits, seq)
    assert torch.equal(parts["prophet_loss"], module.net.prophet_loss(seq, embeds, anchors))
    assert loss is parts["distill_loss"] and loss.item() > 0


def test_cached_top_k_teacher_is_the_main_distribution_renormalised_over_its_top_k(main_export, cache):
    import numpy as np

    from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta

    module = frozen_module(main_export, distill="fkl")
    meta = read_cache_meta(cache)
    batch = cache_rows(open_cache(cache), np.array([0, 7]), meta, top_k=True)
    seq = batch["tokens"]
    main_logits = module.net.model.logits(module.main_embeddings(seq))
    anchors = module.net.anchors(64, 2)
    cached = module._teacher_logits(anchors, None, batch).softmax(-1)
    full = module._teacher_logits(anchors, main_logits, seq)
    top = full.topk(8, dim=-1)
    expected = torch.zeros_like(full).scatter_(-1, top.indices, top.values.softmax(-1))
    torch.testing.assert_close(cached, expected, atol=2e-3, rtol=0)             # fp16 logits in the cache


@pytest.mark.parametrize("data", ["enwik8", "enwik8_embeddings"])       # embeddings online, cached
def test_distilled_runs_train_and_log_the_divergence(compose, tiny_corpus, main_export, cache, tmp_path, data):
    cached = [f"data.cache={cache}"] if data == "enwik8_embeddings" else []
    result = run(frozen_cfg(compose, tiny_corpus, tmp_path / "run", main_export, f"data={data}", *cached,
                            "task.distill=fkl", "task.distill_weight=0.5",
                            "trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.speculative_eval=null"))
    metrics = result["metrics"]
    for key in ("train/loss", "train/prophet_loss", "train/distill_loss", "val/prophet_loss", "val/distill_loss"):
        assert math.isfinite(metrics[key]), key
    mixed = 0.5 * metrics["train/prophet_loss"] + 0.5 * metrics["train/distill_loss"]
    assert metrics["train/loss"] == pytest.approx(mixed, rel=1e-5)


# ---------------------------------------------------------------- a main model with a prophet, of another width

def test_a_model_with_prophet_export_supplies_its_main_model(compose, tiny_corpus, tmp_path):
    torch.manual_seed(1)
    wide = ModelConfig(dim=48, depth=1, heads=3, dim_head=16, max_seq_len=128)
    old = ProphetConfig(model=ModelConfig(dim=48, depth=1, heads=3, dim_head=16, max_seq_len=64))
    export = save_export(tmp_path / "pair", ModelWithProphet(wide, old))
    result = run(frozen_cfg(compose, tiny_corpus, tmp_path / "run", export, "trainer.max_steps=4",
                            "trainer.val_check_interval=2", "callbacks.speculative_eval=null"))
    pair = load_export(result["export_dir"])
    assert pair.main_cfg == wide and pair.prophet_cfg.model.dim == 32        # model=tiny's prophet
    assert isinstance(pair.to_prophet_start, torch.nn.Linear)
    original = load_export(export).model.state_dict()
    assert all(torch.equal(pair.model.state_dict()[k], v) for k, v in original.items())


# ---------------------------------------------------------------- bad input: one line, before any work

def test_a_changed_export_is_refused_when_the_module_loads_it(main_export, tmp_path):
    import shutil

    export = tmp_path / "main"
    shutil.copytree(main_export, export)
    module = FrozenProphetModule(main=MAIN.to_dict(), prophet=ProphetConfig(model=MAIN).to_dict(),
                                 export=str(export), weights_sha256=export_hash(export))
    module.setup("fit")
    torch.manual_seed(5)
    save_export(export, Decoder(MAIN))                                     # another model, same place
    with pytest.raises(SpecdecError, match="now holds another model"):
        module.setup("fit")


@pytest.fixture(scope="module")
def other_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("others")
    torch.manual_seed(3)
    save_export(root / "vocab128", Decoder(ModelConfig(vocab_size=128, dim=32, depth=1, heads=2, dim_head=16,
                                                       max_seq_len=256)))
    save_export(root / "other", Decoder(MAIN))
    save_export(root / "short", Decoder(ModelConfig(dim=32, depth=1, heads=2, dim_head=16, max_seq_len=32)))
    (root / "not_export").mkdir()
    return root


@pytest.mark.parametrize("export,extra,message", [
    (None, ["main.export=null"], "main.export is not set"),
    ("missing", [], "does not exist"),
    ("not_export", [], "is not a specdec export"),
    ("vocab128", [], "vocab_size 256"),
    ("short", [], "exceeds the max_seq_len of main.export"),
    ("main", ["data=enwik8_embeddings"], "data.cache is not set"),
    ("main", ["data=enwik8_embeddings", "data.cache=/nonexistent/cache"], "does not exist"),
    ("main", ["data._target_=train.data.hf_text.HFTextDataModule"], "task=prophet_frozen trains on Enwik8DataModule"),
    ("other", ["data=enwik8_embeddings", "data.cache=CACHE"], "made by another model than main.export"),
    ("main", ["data=enwik8_embeddings", "data.cache=CACHE", "data.seq_len=32"], "holds windows of seq_len 64"),
    ("main", ["gamma=7"], "must be >= gamma + 1"),
    ("main", ["task.distill=ce"], "task.distill must be null or one of fkl, rkl, jsd, tvd"),
    ("main", ["task.distill=fkl", "task.distill_weight=0"], "task.distill_weight must be in (0, 1]"),
    ("main", ["data=enwik8_embeddings", "data.cache=PLAIN", "task.distill=fkl"], "needs a cache with top-k logits"),
])
def test_bad_input_fails_in_one_line_before_any_work(compose, tiny_corpus, main_export, other_exports, cache,
                                                     tmp_path, export, extra, message):
    path = {None: main_export, "main": main_export}.get(export, other_exports / str(export))
    extra = [e.replace("CACHE", str(cache)) if e.endswith("=CACHE") else e for e in extra]
    if "data.cache=PLAIN" in extra:                                               # a cache without top-k logits
        build_cache(main_export, tiny_corpus, tmp_path / "plain", CacheSettings(seq_len=64, windows=2))
        extra = [e.replace("PLAIN", str(tmp_path / "plain")) for e in extra]
    out = tmp_path / "run"
    cfg = frozen_cfg(compose, tiny_corpus, out, path, *extra)
    with pytest.raises(SpecdecError) as error:
        run(cfg)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


def test_the_experiment_file_validates_with_an_export(compose, main_export):
    cfg = compose(["experiment=enwik8_prophet_frozen", f"main.export={main_export}"])
    kwargs = validate(cfg)
    assert kwargs["main"] == MAIN.to_dict() and kwargs["prophet"]["model"]["dim"] == 256     # model=small's prophet
    assert kwargs["metadata"]["embeddings"] == "online" and cfg.task.name == "prophet_frozen"
    assert cfg.callbacks.checkpoint.monitor == "val/prophet_loss"
