"""The CPU corner's one call, `specdec_models.cpu.prepare_for_device`: models moved and cast for a
device, the dtype "auto" resolved against that device, few-row layers switched on a CPU per layer
dtype and switched back by `undo`; devices checked in one line; the pieces a benchmark turns off
(`pieces_off` in a process, SPECDEC_CPU_OFF for a run) and what the host report says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec_models import SpecdecError
from specdec_models.cpu import (
    PIECES,
    comparisons,
    fast_dtype,
    few_rows,
    host_report,
    pieces_off,
    prepare_for_device,
    resolve_device,
)
from specdec_models.cpu.few_rows import FewRowsLinear, few_rows_pays


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def test_prepare_casts_to_the_dtype_asked_and_auto_is_the_devices_fast_dtype():
    model = _model()
    prepared = prepare_for_device(model, "cpu", "bfloat16")
    assert prepared.dtype == torch.bfloat16 and prepared.device == torch.device("cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if few_rows_pays("cpu", torch.bfloat16):
        assert type(model[0]) is FewRowsLinear and type(model[2]) is FewRowsLinear
    prepared.undo()
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    auto = prepare_for_device([_model(), None], "cpu")          # None entries are skipped
    assert auto.dtype == fast_dtype("cpu")
    auto.undo()
    with pieces_off({"bf16"}):                                   # the dtype rule turned off: fp32
        assert prepare_for_device(_model(), "cpu").dtype == torch.float32


def test_prepare_without_a_dtype_keeps_each_models_own_and_switches_the_layers_that_pay():
    fp32, bf16 = _model(), _model().to(torch.bfloat16)
    shared = nn.Sequential(fp32[0])                              # a layer in two modules is switched once
    with prepare_for_device([fp32, bf16, shared], "cpu", dtype=None) as prepared:
        assert prepared.dtype is None
        assert next(fp32.parameters()).dtype == torch.float32 and next(bf16.parameters()).dtype == torch.bfloat16
        want = [fp32[0], fp32[2]] + ([bf16[0], bf16[2]] if few_rows_pays("cpu", torch.bfloat16) else [])
        assert prepared.layers == want and all(type(m) is FewRowsLinear for m in want)
        x = torch.randn(3, 8)
        with torch.no_grad():                                    # the same function, up to fp32 rounding
            want = F.linear(F.linear(x, fp32[0].weight, fp32[0].bias).relu(), fp32[2].weight, fp32[2].bias)
            torch.testing.assert_close(fp32(x), want, rtol=1e-5, atol=1e-5)
    assert prepared.layers == []
    assert all(type(m) is nn.Linear for model in (fp32, bf16) for m in model if not isinstance(m, nn.ReLU))


def test_a_bad_device_or_model_is_one_line_before_anything_changes():
    model = _model()
    cases = [("tpu", "is not a torch device"), ("meta", "decoding runs on cpu, cuda, mps"), ("cpu:1", "the CPU is cpu")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "no CUDA device is available here"))
    else:
        cases.append((f"cuda:{torch.cuda.device_count()}", "CUDA device"))
    if not torch.backends.mps.is_available():
        cases.append(("mps", "no Apple MPS device"))
    for device, match in cases:
        with pytest.raises(SpecdecError, match=match) as err:
            prepare_for_device(model, device, "bfloat16")
        assert "\n" not in str(err.value)
        assert next(model.parameters()).dtype == torch.float32 and type(model[0]) is nn.Linear
    with pytest.raises(SpecdecError, match="--device 'tpu'"):
        resolve_device("tpu", "--device")
    with pytest.raises(SpecdecError, match="the dtype must be auto, bfloat16 or float32"):
        prepare_for_device(model, "cpu", "float16")
    with pytest.raises(SpecdecError, match="takes torch modules"):
        prepare_for_device(["model"], "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_pieces_off_changes_the_kernels_by_the_hosts_rule_and_restores_them():
    before = few_rows.fp32_library(), few_rows.kernel()
    for piece in ("mkl", "dot", "panels"):
        with pieces_off({piece}) as off:
            assert piece in off
            assert (few_rows.fp32_library(), few_rows.kernel()) == few_rows.rule(off)
        assert (few_rows.fp32_library(), few_rows.kernel()) == before
    assert few_rows.rule(frozenset({"mkl"}))[0] == "onednn"
    assert few_rows.rule(frozenset({"dot", "panels"}))[1] == "torch"
    with pieces_off({"dot"}):
        with pieces_off({"linear"}) as off:                    # blocks nest: both are off inside
            assert off == {"dot", "linear"}


@pytest.mark.parametrize(("value", "expected"), [("linear, bf16", "['bf16', 'linear'] float32 0"),
                                                 ("", "[] None 1"), ("fewrows", "error")])
def test_specdec_cpu_off_turns_pieces_off_for_a_run_and_a_bad_name_is_one_line(value, expected):
    # read once at import, so each case runs in a fresh process
    code = ("import torch; from torch import nn; from specdec_models import SpecdecError; "
            "from specdec_models.cpu import prepare_for_device; from specdec_models.cpu.pieces import off\n"
            "try:\n"
            "    p = prepare_for_device(nn.Linear(4, 4), 'cpu', 'auto')\n"
            "    print(sorted(off()), str(p.dtype).removeprefix('torch.') if 'bf16' in off() else None,\n"
            "          len(p.layers))\n"
            "except SpecdecError as e:\n"
            "    print('error' if '\\n' not in str(e) and 'no piece fewrows' in str(e) else repr(e))\n")
    env = {**os.environ, "SPECDEC_CPU_OFF": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_the_host_report_and_the_comparisons_name_this_hosts_pieces():
    report = host_report()
    assert set(report["pieces_used"]) == set(PIECES) and report["pieces_used"]["linear"]
    assert report["dtype"] == str(fast_dtype("cpu")).removeprefix("torch.")
    assert report["float32_layers"].startswith("few-row linear layers (")
    found = comparisons()
    names = [name for name, _, _ in found]
    assert names[0] == "linear float32" and names[-1] == "bf16"
    assert ("linear bfloat16" in names) == few_rows_pays("cpu", torch.bfloat16)
    for name, on, off in found:
        assert on != off and on[1] == frozenset()
        if name in PIECES and name != "bf16":
            assert report["pieces_used"][name] and off == (torch.float32, frozenset({name}))
    assert found[-1][1:] == ((torch.bfloat16, frozenset()), (torch.float32, frozenset()))


def test_no_module_of_the_cpu_corner_writes_another_modules_globals():
    """A choice owned by one module changes through that module's setter (`few_rows.set_fp32_rule`),
    never by an assignment `other_module.name = ...` from outside."""
    import ast
    from pathlib import Path

    import specdec_models.cpu as corner

    writes = []
    for path in sorted(Path(corner.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                            and leaf.value.id in modules:
                        writes.append(f"{path.name}:{leaf.lineno} {leaf.value.id}.{leaf.attr}")
    assert writes == []
