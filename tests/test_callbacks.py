"""SpeculativeEval: a short fit with a tiny ModelWithProphet and stub Lightning modules built here
(no dependency on the tasks or the DataModules), checking what the callback logs and writes."""

from __future__ import annotations

import csv
import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from conftest import StopAt

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.decode import SpeedProfile
from specdec_models.decode.cost import stored_profile
from specdec_models.errors import SpecdecError
from train.callbacks import SAMPLES_FILE, SpeculativeEval, temperature_tag
from train.data.streams import SpecdecDataModule
from train.tasks import SpeculativeModels

GAMMA = 3
TEXT = b"the quick brown fox jumps over the lazy dog. a prophet drafts, the main model verifies. " * 20


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far more so on a CPU shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_net() -> ModelWithProphet:
    torch.manual_seed(0)
    main = ModelConfig(dim=32, depth=2, heads=2, dim_head=16, max_seq_len=256)
    prophet = ProphetConfig(model=ModelConfig(dim=32, depth=1, heads=2, dim_head=16, max_seq_len=32),
                            prophet_train_length=GAMMA + 2)
    return ModelWithProphet(main, prophet)


class StubModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def training_step(self, batch, batch_idx):
        return self.net(batch).loss

    def speculative_models(self) -> SpeculativeModels:
        return SpeculativeModels(target=self.net.model, prophet=self.net)

    def validation_step(self, batch, batch_idx):
        self.log("val/main_loss", self.net(batch).main_loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3)


class StubData(SpecdecDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.data = torch.tensor(list(TEXT))

    def windows(self, count: int, length: int) -> torch.Tensor:
        starts = torch.arange(count) * 37
        return torch.stack([self.data[s:s + length] for s in starts.tolist()])

    def train_dataloader(self):
        return DataLoader(self.windows(8, 33), batch_size=2)

    def val_dataloader(self):
        return DataLoader(self.windows(4, 33), batch_size=2)

    def prompts(self, count: int, length: int) -> torch.Tensor:
        return self.windows(count, length)

    def decode_text(self, tokens: torch.Tensor) -> str:
        return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def fit(tmp_path, callback: SpeculativeEval, precision: str = "32-true", **trainer_kwargs):
    trainer_kwargs = {"max_steps": 3, "val_check_interval": 3, **trainer_kwargs}
    trainer = L.Trainer(limit_val_batches=1, num_sanity_val_steps=1,
                        logger=CSVLogger(tmp_path, name="csv", version=""), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        precision=precision, default_root_dir=tmp_path, log_every_n_steps=1, callbacks=[callback],
                        **trainer_kwargs)
    module = StubModule()
    trainer.fit(module, datamodule=StubData())
    return trainer, module


def logged_metrics(tmp_path) -> dict[str, float]:
    values: dict[str, float] = {}
    with open(tmp_path / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values.update({k: float(v) for k, v in row.items() if v not in ("", None) and k.startswith("val/")})
    return values


def test_eval_callback_logs_acceptance_metrics_and_writes_samples_after_validation_only(tmp_path):
    callback = SpeculativeEval(num_prompts=2, prompt_len=12, max_new_tokens=10, gamma=GAMMA, temperatures=[0.0, 1.0])
    trainer, module = fit(tmp_path, callback)
    metrics = logged_metrics(tmp_path)
    for t in ("t0", "t1"):
        for name in ("acceptance_rate", "alpha", *(f"per_position_acceptance/pos{i}" for i in range(1, GAMMA + 1))):
            value = metrics[f"val/{name}/{t}"]
            assert 0.0 <= value <= 1.0, (name, t, value)
        assert 1.0 <= metrics[f"val/tokens_per_call/{t}"] <= GAMMA + 1
        for name in ("base_tokens_per_second", "spec_tokens_per_second", "speedup"):
            assert math.isfinite(metrics[f"val/{name}/{t}"]) and metrics[f"val/{name}/{t}"] > 0
        # position i is reached only after positions 1..i-1 were accepted
        rates = [metrics[f"val/per_position_acceptance/pos{i}/{t}"] for i in range(1, GAMMA + 1)]
        assert rates == sorted(rates, reverse=True)
    assert metrics["val/spec_eval_seconds"] > 0
    assert "val/acceptance_rate/t0" in trainer.callback_metrics
    assert module.training and module.net.training          # train mode restored

    # one validation epoch after the sanity check: 2 prompts x 2 temperatures
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert len(lines) == 4
    assert {(r["temperature"], r["prompt_index"]) for r in lines} == {(0.0, 0), (0.0, 1), (1.0, 0), (1.0, 1)}
    assert all(r["step"] == 3 and r["prompt"] == TEXT[37 * r["prompt_index"]:][:12].decode() for r in lines)
    assert all(len(r["continuation"]) > 0 for r in lines)
    # greedy speculative decoding is exact (fp32): its samples equal plain greedy decoding's
    assert all(r["matches_base"] for r in lines if r["temperature"] == 0.0)


@pytest.mark.parametrize("off", [False, True])
def test_eval_callback_decodes_with_its_models_prepared_for_the_cpu_and_restores_them(tmp_path, monkeypatch, off):
    """fp32 on a CPU: decoding goes through the layers `prepare_for_device` switches (as the
    decoding CLI does), through none with the piece turned off; training's layers are plain
    nn.Linear again after each evaluation."""
    from specdec_models import cpu

    calls = []
    prepare = cpu.prepare_for_device

    def spy(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        for layer in prepared.layers:                                 # counts the calls while switched
            layer.register_forward_hook(lambda m, i, o: calls.append(1) if type(m) is not torch.nn.Linear else None)
        return prepared

    monkeypatch.setattr("train.callbacks.evaluation.prepare_for_device", spy)
    callback = SpeculativeEval(num_prompts=1, prompt_len=12, max_new_tokens=6, gamma=GAMMA, temperatures=[0.0])
    with cpu.pieces_off({"linear"} if off else ()):
        _, module = fit(tmp_path, callback)
    assert callback.last_metrics["val/tokens_per_call/t0"] >= 1
    assert (len(calls) > 0) == (not off)
    layers = [type(m) for m in module.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(t is torch.nn.Linear for t in layers)
    with pytest.raises(TypeError, match="few_rows"):                 # no longer a setting: the corner decides
        SpeculativeEval(few_rows="auto")


def test_eval_callback_every_n_validations_decodes_at_every_nth_and_the_last(tmp_path):
    """every=2 over 5 validations (after steps 1..5): decodes after the 2nd, the 4th and the one
    that ends training (max_steps), and its count of validations is checkpointed."""
    callback = SpeculativeEval(num_prompts=1, prompt_len=12, max_new_tokens=4, gamma=GAMMA, temperatures=[0.0],
                               every=2)
    fit(tmp_path, callback, max_steps=5, val_check_interval=1)
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 5]
    assert callback.state_dict()["validations"] == 5
    resumed = SpeculativeEval(every=2)
    resumed.load_state_dict(callback.state_dict())
    assert resumed._validations == 5
    for bad in (-1, 1.5, True):
        with pytest.raises(SpecdecError, match="speculative_eval.every must be an integer >= 0"):
            SpeculativeEval(every=bad)


@pytest.mark.parametrize("every", [10, 0])
def test_eval_callback_every_n_decodes_at_a_signalled_stop(tmp_path, every):
    """every=10 or 0 (only at the end), stopped after step 3 (conftest's StopAt sets should_stop as
    Lightning's Timer does when max_time runs out): the validation at that stop decodes, and
    without the stop only the one at max_steps does."""
    callback = SpeculativeEval(num_prompts=1, prompt_len=12, max_new_tokens=4, gamma=GAMMA, temperatures=[0.0],
                               every=every)
    trainer, _ = fit(tmp_path, callback, max_steps=8, val_check_interval=1)
    assert trainer.global_step == 8                         # without the stop: 8 steps, no decoding before the last
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [8]
    (tmp_path / SAMPLES_FILE).unlink()
    stopped = SpeculativeEval(num_prompts=1, prompt_len=12, max_new_tokens=4, gamma=GAMMA, temperatures=[0.0],
                              every=every)
    trainer = L.Trainer(max_steps=8, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=tmp_path, callbacks=[StopAt(3), stopped])
    trainer.fit(StubModule(), datamodule=StubData())
    assert trainer.global_step == 3
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [3]


def test_eval_callback_chooses_gamma_per_temperature_and_batch_and_checkpoints_the_profiles(tmp_path):
    callback = SpeculativeEval(num_prompts=2, prompt_len=12, max_new_tokens=10, gamma=GAMMA, temperatures=[0.0, 1.0])
    trainer, module = fit(tmp_path, callback)
    metrics = logged_metrics(tmp_path)
    # one profile per temperature and batch size (1 and num_prompts), each the prediction it logged
    assert sorted((p["temperature"], p["batch"]) for p in callback.speed_profiles) == [(0.0, 1), (0.0, 2),
                                                                                         (1.0, 1), (1.0, 2)]
    for stored in callback.speed_profiles:
        profile, tag, b = SpeedProfile.from_dict(stored), temperature_tag(stored["temperature"]), stored["batch"]
        # the logged metrics are float32: 5/6 reads 0.8333333134651184 there
        assert list(profile.per_position_acceptance) == pytest.approx(
            [metrics[f"val/per_position_acceptance/pos{i}/{tag}"] for i in range(1, GAMMA + 1)], rel=1e-6)
        assert sorted(profile.v_by_gamma) == list(range(1, GAMMA + 1)) and profile.c > 0
        best = profile.best_gamma(plain=True)      # 0 where no gamma beats plain decoding (predicted 1)
        assert metrics[f"val/best_gamma/b{b}/{tag}"] == best
        assert metrics[f"val/best_predicted_speedup/b{b}/{tag}"] == pytest.approx(profile.predicted(best))
        assert all(profile.predicted(best) >= profile.predicted(g) for g in range(GAMMA + 1))
    for tag in ("t0", "t1"):
        assert math.isfinite(metrics[f"val/predicted_speedup/{tag}"]) and metrics[f"val/predicted_speedup/{tag}"] > 0
    # the profiles travel in the checkpoint (callback state, and the callback's export metadata,
    # where export_checkpoint finds them)
    from train.checkpoints import export_metadata_of

    path = tmp_path / "state.ckpt"
    trainer.save_checkpoint(path)
    restored = SpeculativeEval()
    ckpt = torch.load(path, weights_only=False)
    restored.load_state_dict(ckpt["callbacks"][callback.state_key])
    assert restored.speed_profiles == callback.speed_profiles
    assert export_metadata_of(ckpt) == callback.export_metadata() == {"speed_profiles": callback.speed_profiles}
    assert export_metadata_of({"callbacks": {}}) == {} and SpeculativeEval().export_metadata() == {}


def test_stored_profile_picks_the_nearest_temperature_then_batch():
    def stored(temperature, batch, c):
        return {"temperature": temperature, **SpeedProfile(c, {1: 1.2}, [0.5], batch).to_dict()}

    metadata = {"speed_profiles": [stored(0.0, 1, 0.1), stored(0.0, 8, 0.2), stored(1.0, 1, 0.3), stored(1.0, 8, 0.4)]}
    assert stored_profile(metadata, 0.0, 1).c == 0.1
    assert stored_profile(metadata, 0.2, 6).c == 0.2
    assert stored_profile(metadata, 0.7, 2).c == 0.3
    assert stored_profile(metadata, 2.0, 64).c == 0.4
    single = SpeedProfile(0.5, {2: 1.5}, [0.9, 0.8])
    assert stored_profile({"speed_profile": single.to_dict()}, 1.0, 1) == single
    assert stored_profile({}, 1.0, 1) is None
    with pytest.raises(SpecdecError, match="each with its temperature"):
        stored_profile({"speed_profiles": [single.to_dict()]}, 1.0, 1)


def test_eval_runs_in_fp32_under_bf16_mixed_and_logs_to_wandb_table(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "disabled")
    tables = []
    monkeypatch.setattr(WandbLogger, "log_table", lambda self, key, columns, data, step=None: tables.append(
        (key, columns, data, step)))
    seen = []
    original = SpeculativeEval._evaluate_at

    def spy(self, models, prompts, temperature, *args):
        seen.append((torch.is_autocast_enabled("cpu"), models.target.training or models.prophet.training,
                     torch.is_inference_mode_enabled(), torch.get_num_threads()))
        return original(self, models, prompts, temperature, *args)

    monkeypatch.setattr(SpeculativeEval, "_evaluate_at", spy)
    torch.set_num_threads(2)
    callback = SpeculativeEval(num_prompts=2, prompt_len=8, max_new_tokens=6, gamma=GAMMA, temperatures=[0.0],
                               num_threads=1)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=WandbLogger(save_dir=str(tmp_path), mode="disabled"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        precision="bf16-mixed", default_root_dir=tmp_path, callbacks=[callback], log_every_n_steps=1)
    try:
        trainer.fit(StubModule(), datamodule=StubData())
    finally:
        import wandb

        wandb.finish()            # no W&B run left behind for later tests (WandbLogger would reuse it)
    # no autocast, eval mode, inference mode, one thread while decoding (and two again after)
    assert seen == [(False, False, True, 1)] and torch.get_num_threads() == 2
    assert len(tables) == 1
    key, columns, data, step = tables[0]
    assert key == "val/samples" and step == 2 and len(data) == 2
    assert {"prompt", "continuation", "temperature", "acceptance_rate", "tokens_per_call"} <= set(columns)
    assert 0.0 <= callback.last_metrics["val/acceptance_rate/t0"] <= 1.0


def test_temperature_tags_and_argument_errors():
    assert [temperature_tag(t) for t in (0, 0.0, 1, 0.7)] == ["t0", "t0", "t1", "t0.7"]
    with pytest.raises(SpecdecError, match="gamma"):
        SpeculativeEval(gamma=0)
    with pytest.raises(SpecdecError, match="num_threads"):
        SpeculativeEval(num_threads=0)
    with pytest.raises(SpecdecError, match="duplicates"):
        SpeculativeEval(temperatures=[1, 1.0])
    with pytest.raises(SpecdecError, match="prophet_train_length"):
        SpeculativeEval(gamma=GAMMA + 2).check_model(tiny_net())
    with pytest.raises(SpecdecError, match="DEPTH,TOPK,WIDTH"):
        SpeculativeEval(tree="3x2")
    with pytest.raises(SpecdecError, match="EAGLE-3 head only"):
        SpeculativeEval(gamma=GAMMA, tree="2,2,1").check_model(tiny_net())


def test_eval_callback_checks_its_module_in_setup_before_any_step(tmp_path):
    """A Trainer built outside train.run gets the same check, from the callback's setup hook."""
    callback = SpeculativeEval(num_prompts=2, prompt_len=12, max_new_tokens=250, gamma=GAMMA)
    with pytest.raises(SpecdecError, match="exceeds the target's max_seq_len 256"):
        fit(tmp_path, callback)
    assert not (tmp_path / "csv" / "metrics.csv").exists()      # no step ran
