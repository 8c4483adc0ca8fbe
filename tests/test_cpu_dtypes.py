"""specdec_models/dtypes.py and train/dtypes.py: the dtype decoding and caching run in and the
training precision a config resolves to are decided by the machine's flags and vendor (on a CPU: AMX,
or avx512_bf16 on AMD; bf16 support on CUDA), never by a clock. Every command line names a dtype in
one vocabulary (auto, fp32, bf16, fp16; torch's names as aliases), parsed in one place."""

from __future__ import annotations

import pytest
import torch

from specdec_models.cpu import dtypes

XEON_NO_AMX = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_fp16\n\n"
               "processor\t: 1\nflags\t\t: fpu\n")
XEON_AMX = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx avx2 fma f16c\n"
EPYC_AVX512_BF16 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n\n"
                    "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """machine(text): the dtype rules read `text` as this machine's /proc/cpuinfo."""
    def use(text: str) -> None:
        info = tmp_path / "cpuinfo"
        info.write_text(text)
        monkeypatch.setattr(dtypes, "_CPUINFO", str(info))
    return use


def test_cpu_flags_and_vendor_are_the_first_cpus_and_empty_without_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(XEON_NO_AMX)
    assert dtypes.cpu_flags(info) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16", "avx512_fp16"}
    assert dtypes.cpu_vendor(info) == "GenuineIntel"
    info.write_text(EPYC_AVX512_BF16)                # the second CPU's vendor and flags are not read
    assert dtypes.cpu_vendor(info) == "AuthenticAMD" and "avx512_bf16" in dtypes.cpu_flags(info)
    assert dtypes.cpu_flags(tmp_path / "missing") == frozenset()
    assert dtypes.cpu_vendor(tmp_path / "missing") == ""


# an AMD CPU with AVX2 only, or an Intel one with avx512_bf16 but no AMX, trains faster in fp32
AMD_AVX512_BF16_NO_VENDOR = EPYC_AVX512_BF16.replace("vendor_id\t: AuthenticAMD\n", "")


@pytest.mark.parametrize("cpuinfo, expected", [(XEON_AMX, "bf16-mixed"), (EPYC_AVX512_BF16, "bf16-mixed"),
                                               (XEON_NO_AMX, "32-true"), (EPYC_AVX2, "32-true"),
                                               (AMD_AVX512_BF16_NO_VENDOR, "32-true"), ("", "32-true")])
@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_a_cpu_trains_in_bf16_mixed_with_amx_or_with_avx512_bf16_on_amd(monkeypatch, machine, cpuinfo, expected,
                                                                        accelerator):
    machine(cpuinfo)
    monkeypatch.setattr(dtypes.torch.cuda, "is_available", lambda: False)
    assert dtypes.fast_precision(accelerator) == expected


@pytest.mark.parametrize("cpuinfo, expected", [(XEON_AMX, torch.bfloat16), (XEON_NO_AMX, torch.bfloat16),
                                               (EPYC_AVX2, torch.float32), ("", torch.float32)])
def test_decoding_and_caching_on_a_cpu_run_in_bf16_only_with_bf16_instructions(monkeypatch, machine, cpuinfo,
                                                                                 expected):
    machine(cpuinfo)
    monkeypatch.setattr(dtypes.torch.cuda, "is_available", lambda: False)
    assert dtypes.fast_dtype("cpu") == dtypes.resolve_dtype("auto") == expected
    assert dtypes.resolve_dtype("float32") == torch.float32       # a named dtype is taken as given
    assert dtypes.resolve_dtype("bfloat16") == torch.bfloat16


@pytest.mark.parametrize("bf16", [True, False])
def test_a_cuda_device_decodes_in_bf16_where_it_has_bf16_whatever_the_host_cpu(monkeypatch, machine, bf16):
    machine(EPYC_AVX2)
    monkeypatch.setattr(dtypes.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dtypes.torch.cuda, "is_bf16_supported", lambda: bf16)
    expected = torch.bfloat16 if bf16 else torch.float32
    assert dtypes.fast_dtype("cuda") == dtypes.fast_dtype("cuda:0") == expected
    assert dtypes.resolve_dtype("auto", "cuda") == expected
    assert dtypes.fast_dtype("cpu") == torch.float32              # the CPU beside it: AVX2 only
    assert dtypes.fast_dtype("mps") == torch.float32              # Apple's GPU: bf16 depends on the macOS version


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_a_cuda_device_trains_in_bf16_mixed_where_it_has_bf16(monkeypatch, machine, bf16, expected):
    machine(XEON_NO_AMX)                             # the host CPU does not matter on a GPU
    monkeypatch.setattr(dtypes.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dtypes.torch.cuda, "is_bf16_supported", lambda: bf16)
    assert dtypes.fast_precision("gpu") == expected
    assert dtypes.fast_precision("cpu") == "32-true"   # trainer=cpu trains on the CPU even beside a GPU


@pytest.mark.parametrize("experiment", ["smollm2_eagle3", "smollm2_prophet"])
@pytest.mark.parametrize("cpuinfo, expected", [(XEON_AMX, "bf16-mixed"), (EPYC_AVX512_BF16, "bf16-mixed"),
                                               (XEON_NO_AMX, "32-true")])
def test_the_smollm2_experiments_resolve_their_precision_from_the_machine(compose, machine, experiment, cpuinfo,
                                                                          expected):
    machine(cpuinfo)
    cfg = compose([f"experiment={experiment}"])
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == expected
    assert compose([f"experiment={experiment}", "trainer.precision=32-true"]).trainer.precision == "32-true"


@pytest.mark.parametrize("experiment", ["smollm2_eagle3", "smollm2_prophet"])
@pytest.mark.parametrize("cpuinfo, expected", [(XEON_AMX, "bfloat16"), (XEON_NO_AMX, "bfloat16"),
                                               (EPYC_AVX2, "float32")])
def test_the_smollm2_heads_run_their_frozen_target_in_the_machines_fast_dtype(compose, machine, monkeypatch,
                                                                              experiment, cpuinfo, expected):
    # the target only runs forward passes: emulated bf16 on an AVX2-only CPU made the recipe's
    # prophet steps take 36 s there
    machine(cpuinfo)
    monkeypatch.setattr(dtypes.torch.cuda, "is_available", lambda: False)
    assert compose([f"experiment={experiment}"]).target.dtype == expected
    assert compose([f"experiment={experiment}", "target.dtype=float32"]).target.dtype == "float32"


# ------------------------------------------------------------------------------ one vocabulary on every command line

def test_every_dtype_name_and_its_alias_parse_to_torchs_name():
    from specdec_models import SpecdecError

    for short, alias, torch_name in (("fp32", "float32", "float32"), ("bf16", "bfloat16", "bfloat16"),
                                     ("fp16", "float16", "float16")):
        assert dtypes.parse_dtype(short) == dtypes.parse_dtype(alias) == torch_name
        assert dtypes.resolve_dtype(short, "cuda") == dtypes.resolve_dtype(alias, "cuda") == getattr(torch, torch_name)
    assert dtypes.parse_dtype("auto") == "auto"
    assert dtypes.parse_dtype("int8", dtypes.STORAGE_DTYPES) == "int8"
    assert dtypes.parse_dtype("bfloat16", dtypes.STORAGE_DTYPES) == "bfloat16"
    for bad, allowed, match in (("fp8", dtypes.COMPUTE_DTYPES, "--dtype must be one of auto, fp32, bf16, fp16 "
                                                              r"\(or float32, bfloat16, float16\), got 'fp8'"),
                                ("int8", dtypes.COMPUTE_DTYPES, "got 'int8'"),
                                ("fp32", dtypes.STORAGE_DTYPES, r"one of bf16, fp16, int8 \(or bfloat16, float16\)")):
        with pytest.raises(SpecdecError, match=match) as err:
            dtypes.parse_dtype(bad, allowed)
        assert "\n" not in str(err.value)
    # fp16 computes only on a CUDA device: on a CPU it is one line, in the words resolve_dtype always used
    with pytest.raises(SpecdecError, match="float16 on cpu: the dtype must be auto, bfloat16 or float32 there"):
        dtypes.resolve_dtype("fp16", "cpu")


def test_a_dtype_flag_takes_the_names_and_aliases_and_has_one_help_text():
    import argparse

    parser = argparse.ArgumentParser()
    dtypes.add_dtype_argument(parser, what="the target's dtype")
    dtypes.add_dtype_argument(parser, "--store", default="bf16", allowed=dtypes.STORAGE_DTYPES)
    assert vars(parser.parse_args([])) == {"dtype": "auto", "store": "bfloat16"}
    assert vars(parser.parse_args(["--dtype", "bf16", "--store", "int8"])) == {"dtype": "bfloat16", "store": "int8"}
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"
    help_text = " ".join(parser.format_help().split())
    assert ("the target's dtype: auto | fp32 | bf16 | fp16 (float32, bfloat16, float16 also accepted); auto:"
            in help_text)
    assert "bf16 | fp16 | int8 (bfloat16, float16 also accepted) (default bf16)" in help_text

    class OneLine(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    one = OneLine()
    dtypes.add_dtype_argument(one)
    with pytest.raises(ValueError, match="argument --dtype: --dtype must be one of auto, fp32, bf16, fp16"):
        one.parse_args(["--dtype", "half"])


def test_no_command_line_declares_a_dtype_flag_of_its_own():
    """Every --dtype, --model-dtype, --data-dtype goes through `add_dtype_argument` (one parser, one
    help text): no add_argument call names a flag ending in 'dtype' anywhere in the code."""
    import ast

    from conftest import REPO

    found = []
    for root in ("scripts", "train", "specdec_models"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                        and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).endswith("dtype")):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
