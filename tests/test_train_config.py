"""Configs: every experiment and group option composes and validates; bad values stop a run
with a one-line error before anything is created."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import CONF, REPO, command

from specdec_models import ModelConfig, ProphetConfig
from specdec_models.errors import SpecdecError
from train.run import run, validate

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_every_experiment_the_readme_and_makefile_name_is_one_that_composes(compose):
    import re

    docs = (REPO / "README.md").read_text() + (REPO / "Makefile").read_text()
    named = set(re.findall(r"experiment=([a-z0-9_]+)", docs))
    assert {"enwik8_prophet", "tiny"} <= named                 # the two the README's commands run
    assert named <= set(EXPERIMENTS), sorted(named - set(EXPERIMENTS))
    for name in sorted(named):
        assert compose([f"experiment={name}"]).name == name


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(compose, experiment, tiny_decoder_export):
    task = compose([f"experiment={experiment}"]).task.name
    if task in ("hf_draft_distill", "hf_prophet", "hf_eagle3", "hf_dflash", "hf_peagle"):
        pytest.skip("validated with tiny Hugging Face models in test_hf_distill.py, test_hf_prophet_task.py, "
                    "test_hf_eagle3_task.py, test_hf_dflash_task.py and test_hf_peagle_task.py")
    # experiments that start from a trained model are given one (an export of a tiny decoder)
    extra = {"draft_distill": [f"teacher.export={tiny_decoder_export}", "student=tiny"],
             "prophet_frozen": [f"main.export={tiny_decoder_export}"]}.get(task, [])
    cfg = compose([f"experiment={experiment}", *extra])
    kwargs = validate(cfg)
    assert cfg.name == experiment and kwargs["metadata"]["name"] == experiment
    if "prophet" in kwargs:
        assert kwargs["prophet"]["prophet_train_length"] >= cfg.gamma + 1
    first = (CONF / "experiment" / f"{experiment}.yaml").read_text().splitlines()
    assert first[0] == "# @package _global_" and first[1].startswith("# Run: python -m train experiment=")


# what each group option needs to compose and validate: the task it belongs to and its inputs
OPTION_NEEDS = {
    ("task", "prophet_frozen"): ["main.export=EXPORT"],
    ("task", "draft_distill"): ["teacher.export=EXPORT", "+student=tiny", "+objective=distill", "~model"],
    ("task", "hf_draft_distill"): None,                      # validated with tiny HF models in test_hf_distill.py
    ("task", "hf_prophet"): None,                            # ... and in test_hf_prophet_task.py
    ("task", "hf_eagle3"): None,                             # ... and in test_hf_eagle3_task.py
    ("task", "hf_dflash"): None,                             # ... and in test_hf_dflash_task.py
    ("task", "hf_peagle"): None,                             # ... and in test_hf_peagle_task.py
    ("data", "hf_embeddings"): None,                         # test_hf_prophet_task.py
    ("data", "enwik8_embeddings"): ["task=prophet_frozen", "main.export=EXPORT", "data.cache=CACHE"],
    ("data", "hf_text"): None,                               # test_hf_distill.py
    ("data", "hf_chat"): None,                               # test_chat_rows.py
    ("student", None): ["task=draft_distill", "teacher.export=EXPORT", "+objective=distill", "~model"],
    ("objective", None): ["task=draft_distill", "teacher.export=EXPORT", "+student=tiny", "~model"],
}
GROUP_OPTIONS = sorted((group.name, option.stem) for group in CONF.iterdir() if group.is_dir()
                       and group.name != "experiment" for option in group.glob("*.yaml"))


def test_every_default_of_train_yaml_is_a_group_option_the_parametrized_test_covers(compose):
    """conf/train.yaml's defaults list picks options of GROUP_OPTIONS (so the test below checks
    what a plain `python -m train` composes), and composing them gives each option's own values."""
    import yaml

    defaults = [d for d in yaml.safe_load((CONF / "train.yaml").read_text())["defaults"]
                if isinstance(d, dict) and not next(iter(d)).startswith("override")]
    chosen = {next(iter(d)): next(iter(d.values())) for d in defaults}
    assert {g for g in chosen if chosen[g] is not None} == {"task", "model", "data", "optim", "trainer", "logger",
                                                             "callbacks"}
    cfg = compose([])
    for group, option in chosen.items():
        if option is None:
            continue
        assert (group, option) in GROUP_OPTIONS
        assert_option_applied(cfg, group, option)


def assert_option_applied(cfg, group: str, option: str) -> None:
    """cfg holds what conf/<group>/<option>.yaml sets: its _target_s, names, sizes and objective
    (the values that say which option was composed; an experiment may change the others); an
    empty option (logger=none) leaves the group empty."""
    import yaml

    text = (CONF / group / f"{option}.yaml").read_text()
    node = yaml.safe_load(text) or {}
    if "# @package _global_" not in text.splitlines()[:3]:
        node = {group: node}
    node.pop("defaults", None)
    if not node.get(group, True):
        assert not cfg.get(group), (group, option)
        return

    def identities(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from identities(value, f"{prefix}{key}.")
            elif key in ("_target_", "name", "dim", "depth", "divergence", "data"):
                yield f"{prefix}{key}", value

    found = list(identities(node))
    assert found, f"{group}/{option}.yaml sets nothing that says it was composed"
    for key, value in found:
        assert OmegaConf.select(cfg, key) == value, (group, option, key)


@pytest.mark.filterwarnings("ignore:the student .* is not smaller")  # tiny teacher, real student sizes
@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes_and_validates(compose, group, option, tiny_decoder_export, tmp_path):
    """Every option of every group directory (globbed: a new file is tested without editing this)
    composes on top of experiment=tiny and passes validation."""
    needs = OPTION_NEEDS.get((group, option), OPTION_NEEDS.get((group, None), []))
    prefix = "+" if group in ("student", "objective") else ""
    if needs is None:
        cfg = compose(["experiment=tiny", f"{group}={option}"])       # composes; validated elsewhere
        assert_option_applied(cfg, group, option)
        return
    extra = [n.replace("EXPORT", str(tiny_decoder_export)) for n in needs]
    if any("CACHE" in n for n in extra):
        from train.data.embeddings_cache import CacheSettings, build_cache

        cache = tmp_path / "cache"
        build_cache(tiny_decoder_export, REPO / "README.md", cache, CacheSettings(seq_len=64, windows=2))
        extra = [n.replace("CACHE", str(cache)) for n in extra]
    cfg = compose(["experiment=tiny", *extra, f"{prefix}{group}={option}"])
    kwargs = validate(cfg)
    assert kwargs["metadata"]["task"] == cfg.task.name
    assert_option_applied(cfg, group, option)


def test_enwik8_prophet_is_the_seed_recipe(compose):
    cfg = compose(["experiment=enwik8_prophet"])
    main = ModelConfig.from_dict(OmegaConf.to_container(cfg.model.main))
    prophet = ProphetConfig.from_dict(OmegaConf.to_container(cfg.model.prophet))
    assert (main.dim, main.depth, prophet.model.dim, prophet.model.depth) == (512, 10, 512, 2)
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) == (512, 4, 4)
    assert (cfg.optim.name, cfg.optim.lr, cfg.trainer.gradient_clip_val) == ("adam", 1e-4, 0.5)
    assert cfg.gamma == 5 and prophet.prophet_train_length == cfg.gamma + 2
    assert prophet.num_leading_start_tokens == 2 and prophet.windows_per_seq is None
    assert list(cfg.logger) == ["wandb"] and cfg.trainer.accelerator == "auto"
    assert cfg.trainer.precision == "32-true"


def test_unknown_key_is_a_composition_error(compose):
    with pytest.raises(ConfigCompositionException):
        compose(["experiment=tiny", "data.seqlen=64"])


@pytest.mark.parametrize("override,message", [
    ("gamma=7", "prophet_train_length (7) must be >= gamma + 1"),
    ("model.main.dim_head=15", "dim_head must be even"),
    ("model.prophet.model.vocab_size=128", "byte-level data needs vocab_size 256"),
    ("data.seq_len=512", "exceeds model.main.max_seq_len"),
    ("data.seq_len=4", "must hold one prophet window"),
    ("optim.name=sgd", "optim.name must be adam or adamw"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("trainer.max_steps=0", "trainer.max_steps must be a positive integer"),
    ("trainer.val_check_interval=0.5", "whole number of batches"),
    ("trainer.accumulate_grad_batches=3", "multiple of trainer.accumulate_grad_batches"),
    ("data.path=/nonexistent/enwik8", "does not exist"),
    ("ckpt_path=/nonexistent/last.ckpt", "does not exist"),
    ("+foo=1", "unknown config key foo: nothing reads it (no file in conf/ defines it)"),
    ("+trainr.max_steps=3", "unknown config key trainr"),
    ("overwrite=yes", "overwrite must be true or false"),
])
def test_bad_values_fail_in_one_line_before_any_work(tiny_cfg, tmp_path, override, message):
    out = tmp_path / "run"
    cfg = tiny_cfg(out, override)
    with pytest.raises(SpecdecError) as error:
        run(cfg)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


@pytest.mark.parametrize("env_mode,logged_in,expected", [(None, False, "offline"), (None, True, None),
                                                          ("disabled", False, None)])
def test_wandb_goes_offline_without_credentials_unless_wandb_mode_says(compose, tmp_path, monkeypatch,
                                                                         env_mode, logged_in, expected):
    import train.run as train_run

    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    monkeypatch.setattr(train_run, "_wandb_logged_in", lambda: logged_in)
    cfg = compose(["experiment=enwik8_prophet", f"output_dir={tmp_path}"])
    (logger,) = train_run.build_loggers(cfg, tmp_path)
    assert logger._wandb_init.get("mode") == expected
    assert logger._wandb_init["project"] == "specdec" and logger._wandb_init["tags"] == ["enwik8", "prophet"]
    assert logger._wandb_init["name"].startswith("enwik8_prophet-")


def test_no_experiment_inherits_from_another():
    import yaml

    for name in EXPERIMENTS:
        for entry in yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text()).get("defaults", []):
            # only `group: option` entries (/student: small, override /trainer: cpu), never another experiment
            assert isinstance(entry, dict), (name, entry)
            group = next(iter(entry)).replace("override ", "").strip("/")
            assert group != "experiment" and group not in EXPERIMENTS, (name, entry)


def test_the_gpu_experiment_is_the_recipes_eagle3_head_at_the_gpu_sizes_that_met_the_goals(compose, tmp_path):
    """experiment=hf_eagle3_gpu composes to what the H100 head that met the goals was trained with
    (experiment=smollm2_eagle3 plus the GPU overrides it once held as constants), every key alike
    but the run's name and tags, the target (SmolLM2's GGUF there, one's own here), its dtype
    (resolved from the machine there, bf16 here) and the recipe's data sizes, which
    scripts/eagle3.py --device cuda reads."""
    from omegaconf import OmegaConf

    gpu = ["trainer.accelerator=gpu", "data.batch_size=64", "data.num_workers=8", "trainer.val_check_interval=500",
           "task.ttt_steps=6", "optim.warmup_steps=100", "task.ttt_ramp=0"]
    same = ["trainer.precision=bf16-mixed", "trainer.max_time=00:00:05:00"]
    before = OmegaConf.to_container(compose(["experiment=smollm2_eagle3", *gpu, *same]), resolve=False)
    after = OmegaConf.to_container(compose(["experiment=hf_eagle3_gpu", *same]), resolve=False)
    for cfg in (before, after):
        for key in ("name", "tags", "recipe"):
            cfg.pop(key, None)
        cfg["target"].pop("path"), cfg["target"].pop("dtype")
    assert before == after
    recipe_block = compose(["experiment=hf_eagle3_gpu"]).recipe
    assert dict(recipe_block) == {"conversations": 12000, "answer_batch": 2048, "answer_chunk": 512,
                                  "chat_cache_batch": 256}


@pytest.mark.parametrize("device, given, expected", [
    ("cpu", {}, (1200, 64, 16, 30.0)),
    ("cuda", {}, (12000, 2048, 256, 5.0)),
    ("cuda", {"cache_batch": 64, "train_minutes": 8.0}, (12000, 2048, 64, 8.0)),
    ("cpu", {"conversations": 100}, (100, 64, 16, 30.0)),
])
def test_the_recipe_sizes_its_data_and_training_for_the_device_unless_told(device, given, expected):
    # --device cuda: the sizes of conf/experiment/hf_eagle3_gpu.yaml; a value given on the command line wins on
    # either device
    import argparse

    script = command("eagle3")
    args = argparse.Namespace(device=device, **{"conversations": None, "answer_batch": None, "answer_chunk": None,
                                                "cache_batch": None, "train_minutes": None, **given})
    got = script.device_defaults(args)
    assert (got.conversations, got.answer_batch, got.cache_batch, got.train_minutes) == expected
