"""The `specdec` command (train/cli.py): `specdec --help` lists every verb, each verb's `--help` is its
own under the name `specdec VERB` (run in this process), an unknown verb is one line and exit 2, and
`--device auto` is cpu on a machine without CUDA, said at the start."""

from __future__ import annotations

import pytest

from train import cli


def test_specdec_help_lists_every_verb_with_one_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in ("plan", "eagle3", "evaluate", "decode", "export", "cache", "draft-vocab", "train"):
        assert any(line.split()[:1] == [verb] and len(line.split()) > 2 for line in out.splitlines()), verb
    assert list(cli.VERBS) == ["plan", "eagle3", "evaluate", "decode", "export", "cache", "draft-vocab", "train"]


@pytest.mark.parametrize("verb", [v for v in cli.VERBS if v != "train"])
def test_each_verbs_help_is_its_own_under_the_name_specdec_verb(verb, capsys):
    import sys

    before = list(sys.argv)
    assert cli.main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: specdec {verb} ") and "--help" in out, out[:200]
    assert sys.argv == before


def test_the_train_verb_passes_its_arguments_to_python_m_train(capfd):
    assert cli.main(["train", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("specdec train [OVERRIDE ...]") and "experiment" in out     # Hydra's help lists the groups
    # an override Hydra cannot compose: `python -m train`'s one line and exit 2
    assert cli.main(["train", "experiment=no_such_experiment"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no_such_experiment" in err


@pytest.mark.parametrize("argv, message", [(["fly"], "unknown verb 'fly'"), ([], "no verb")])
def test_an_unknown_or_missing_verb_is_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err and "plan, eagle3, evaluate" in err


def test_a_verbs_bad_input_keeps_its_own_one_line_and_exit_2(capsys, tmp_path):
    assert cli.main(["plan", "--target", tmp_path / "nothing.txt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is neither a model folder" in err


def test_device_auto_is_cpu_without_cuda_and_cuda_with_it_said_at_the_start(monkeypatch, capsys):
    import torch

    from specdec_models.device import auto_device, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == "cpu" and capsys.readouterr().out == "device: cpu (auto)\n"
    assert pick_device("cuda:1") == "cuda:1" and capsys.readouterr().out == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto_device("auto") == "cuda" and capsys.readouterr().out == ""
