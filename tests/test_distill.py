"""task=draft_distill: the divergences against hand-computed values, the frozen teacher, the
on-policy data path, and tiny end-to-end runs through run(cfg)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_models import SamplingConfig
from specdec_models.errors import SpecdecError
from specdec_models.losses import LOG_FLOOR, divergence

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

P = [0.5, 0.3, 0.2]          # teacher
Q = [0.2, 0.1, 0.7]          # student


def logits(probs):
    return torch.tensor(probs).log()[None]


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)



# -- divergences -------------------------------------------------------------------------------

def test_divergences_equal_hand_computed_values():
    s, t = logits(Q), logits(P)
    assert divergence("fkl", s, t).item() == pytest.approx(kl(P, Q), rel=1e-5)
    assert divergence("rkl", s, t).item() == pytest.approx(kl(Q, P), rel=1e-5)
    assert divergence("tvd", s, t).item() == pytest.approx(0.5 * (0.3 + 0.2 + 0.5), rel=1e-5)
    for beta in (0.5, 0.2):
        m = [beta * p + (1 - beta) * q for p, q in zip(P, Q, strict=True)]
        assert divergence("jsd", s, t, beta=beta).item() == pytest.approx(beta * kl(P, m) + (1 - beta) * kl(Q, m),
                                                                          rel=1e-5)
    assert divergence("ce", s, labels=torch.tensor([[2]])).item() == pytest.approx(-math.log(0.7), rel=1e-5)


def test_divergences_use_the_decoding_temperature_and_filters():
    s, t = logits(Q), logits(P)
    # temperature 2: p ~ p^(1/2)
    p2 = [math.sqrt(x) / sum(math.sqrt(y) for y in P) for x in P]
    q2 = [math.sqrt(x) / sum(math.sqrt(y) for y in Q) for x in Q]
    assert divergence("fkl", s, t, sampling=SamplingConfig(2.0)).item() == pytest.approx(kl(p2, q2), rel=1e-5)
    # top-k 2: the teacher keeps tokens 0, 1 (0.625, 0.375), the student 0, 2 (2/9, 7/9)
    top2 = SamplingConfig(1.0, top_k=2)
    assert divergence("tvd", s, t, sampling=top2).item() == pytest.approx(0.5 * (0.625 - 2 / 9 + 0.375 + 7 / 9),
                                                                       rel=1e-5)
    # the teacher keeps a token the student filtered: log q is floored, the loss stays finite
    fkl = divergence("fkl", s, t, sampling=top2).item()
    assert fkl == pytest.approx(0.625 * math.log(0.625 / (2 / 9)) + 0.375 * (math.log(0.375) - LOG_FLOOR), rel=1e-5)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8)])
def test_divergence_is_zero_when_student_equals_teacher(name, sampling):
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(0))
    assert abs(divergence(name, x, x.clone(), sampling=sampling).item()) < 1e-6


def test_divergence_masks_positions_and_never_sends_gradient_to_the_teacher():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    value = divergence("fkl", s, t, mask=mask)
    manual = divergence("fkl", s[mask], t[mask])
    assert value.item() == pytest.approx(manual.item(), rel=1e-6)
    value.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


def test_divergence_errors():
    x = torch.zeros(1, 4)
    with pytest.raises(SpecdecError, match="unknown divergence 'kld'"):
        divergence("kld", x, x)
    with pytest.raises(SpecdecError, match="temperature > 0"):
        divergence("fkl", x, x, sampling=SamplingConfig(0.0))
    with pytest.raises(SpecdecError, match="beta"):
        divergence("jsd", x, x, beta=1.0)
    with pytest.raises(SpecdecError, match="differ in shape"):
        divergence("rkl", x, torch.zeros(1, 5))


# -- the pipeline ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher_export(tiny_decoder_export):
    """A random tiny decoder (the pipeline's mechanics do not need a trained teacher)."""
    return tiny_decoder_export


@pytest.fixture(scope="module")
def distill_cfg(tiny_corpus, teacher_export):
    from train.run import compose

    def make(output_dir, *extra):
        return compose(["experiment=tiny_draft_distill", f"teacher.export={teacher_export}",
                        f"data.path={tiny_corpus}", "data.allow_short=true", f"output_dir={output_dir}", *extra])
    return make


def build_module(cfg):
    from train.run import validate
    from train.tasks.draft_distill import DraftDistillModule

    module = DraftDistillModule(**validate(cfg))
    module.setup("fit")
    return module


def test_teacher_is_frozen_and_outside_the_students_state(distill_cfg, tmp_path):
    module = build_module(distill_cfg(tmp_path, "objective.data=student"))
    assert all(not p.requires_grad for p in module.teacher.parameters()) and not module.teacher.training
    assert all(name.startswith("student.") for name in module.state_dict())
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.student.parameters()}
    seq = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    loss, *_ = module._loss(seq)
    loss.backward()
    assert all(p.grad is None for p in module.teacher.parameters())
    assert all(p.grad is not None for p in module.student.parameters())


def test_on_policy_rows_are_sampled_from_the_current_student(distill_cfg, tmp_path):
    from specdec_models.decode import generate

    module = build_module(distill_cfg(tmp_path, "objective.data=student"))
    prompts = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    rows = module.sample_rows(prompts, "student", torch.Generator().manual_seed(5))
    assert rows.shape == (4, 8 + 24) and torch.equal(rows[:, :8], prompts)
    # the same draw as decoding the student directly with the same seed ...
    new, _ = generate(module.student, prompts, 24, sampling=SamplingConfig(temperature=1.0),
                      generator=torch.Generator().manual_seed(5))
    assert torch.equal(rows[:, 8:], torch.stack(new))
    assert rows.requires_grad is False and not rows.is_inference()
    # ... and it follows the student: other weights, other rows (same seed)
    with torch.no_grad():
        module.student.to_logits.weight.mul_(-3.0)
    assert not torch.equal(module.sample_rows(prompts, "student", torch.Generator().manual_seed(5)), rows)
    teacher_rows = module.sample_rows(prompts, "teacher", torch.Generator().manual_seed(5))
    new, _ = generate(module.teacher, prompts, 24, sampling=SamplingConfig(temperature=1.0),
                      generator=torch.Generator().manual_seed(5))
    assert torch.equal(teacher_rows[:, 8:], torch.stack(new))


@pytest.mark.parametrize("data,fraction,expected", [("corpus", 1.0, 0), ("student", 0.5, 4), ("teacher", 1.0, 8),
                                                    ("student", 0.0, 0)])
def test_generated_share_of_a_batch(distill_cfg, tmp_path, data, fraction, expected):
    module = build_module(distill_cfg(tmp_path, f"objective.data={data}", f"objective.data_fraction={fraction}"))
    assert module.objective.generated_rows(8) == expected


def test_tiny_distillation_end_to_end_on_policy(distill_cfg, tmp_path, teacher_export):
    from specdec_models import load_export
    from specdec_models.decode import GREEDY, DraftModel, generate
    from specdec_models.export import read_export_config
    from train.run import run

    result = run(distill_cfg(tmp_path / "run", "objective.divergence=jsd", "objective.data=student"))
    assert result["global_step"] == 20
    metrics = result["metrics"]
    for key in ("train/loss", "train/divergence", "val/divergence", "val/bpc", "val/expected_acceptance",
                "val/acceptance_rate/t0", "val/acceptance_rate/t1", "val/tokens_per_call/t1"):
        assert math.isfinite(metrics[key]), key
    assert metrics["train/generated_rows"] == 4
    # the export is the student alone (a decoder), usable as a draft for the teacher
    config = read_export_config(result["export_dir"])
    assert config["kind"] == "decoder" and config["main"]["dim"] == 32
    assert config["metadata"]["teacher_export"] == str(teacher_export.resolve())
    draft, teacher = load_export(result["export_dir"]), load_export(teacher_export)
    prompt = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    spec, _ = generate(teacher, prompt, 12, DraftModel(draft), sampling=GREEDY)
    base, _ = generate(teacher, prompt, 12, sampling=GREEDY)
    assert all(torch.equal(a, b) for a, b in zip(spec, base, strict=True))


@pytest.mark.parametrize("override,message", [
    ("teacher.export=null", "needs teacher.export"),
    ("teacher.export=/nonexistent/export", "/nonexistent/export"),
    ("objective.divergence=kld", "objective.divergence must be one of fkl, rkl, jsd, tvd, ce"),
    ("objective.data_fraction=1.5", r"objective.data_fraction must be in \[0, 1\]"),
    ("objective.data=web", "objective.data must be one of corpus, teacher, student"),
    ("objective.temperature=0", "objective.temperature must be > 0"),
    ("student.vocab_size=512", r"student vocabulary \(512\) differs from the teacher's \(256\)"),
])
def test_bad_distillation_configs_stop_before_training(distill_cfg, tmp_path, override, message):
    from train.run import run

    with pytest.raises(SpecdecError, match=message):
        run(distill_cfg(tmp_path / "run", override))
    assert not (tmp_path / "run").exists()          # nothing created


def test_a_student_as_large_as_the_teacher_warns(distill_cfg, tmp_path):
    from train.run import validate

    with pytest.warns(UserWarning, match="not smaller than the teacher"):
        validate(distill_cfg(tmp_path, "student.dim=64"))


def test_a_changed_teacher_is_refused_on_resume(distill_cfg, tmp_path, teacher_export):
    from train.run import validate
    from train.tasks.draft_distill import DraftDistillModule

    kwargs = validate(distill_cfg(tmp_path))
    module = DraftDistillModule(**{**kwargs, "weights_sha256": "0" * 64})
    with pytest.raises(SpecdecError, match="has changed since this run started"):
        module.setup("fit")
