"""Few-row linear layers (`specdec_models.cpu.few_rows`): the same function as `F.linear` up to fp32
rounding at every row count, by MKL's packed product and by the other rule (either small-row kernel,
torch's or numba's, and oneDNN's packed weights above them, or numba's panel kernel up to 64 rows),
bit for bit `F.linear` in bf16, MKL's
layout checked per weight shape, a packed weight packed again when the weight
changes, torch's own path for training and large fp32 calls, switched in place and back without
touching weights, and greedy decoding through them still the target's own."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec_models import SpecdecError
from specdec_models.cpu import few_rows, few_rows_kernel, pieces_off, prepare_for_device
from specdec_models.cpu.few_rows import (
    LINEAR_ROWS,
    MAX_ROWS,
    PACKED_ROWS,
    SMALL_ROWS,
    FewRowsLinear,
    describe,
    few_rows_pays,
    fp32_library,
    kernel,
    kernel_for,
    mkl_packs,
    packs,
    set_fp32_library,
    set_kernel,
    set_small_rows,
    small_rows_for,
    use_few_rows,
)


@pytest.fixture(params=["torch", "numba", "panels"])
def each_kernel(request):
    """Run the test with each few-row kernel (numba's two where numba is installed), then restore it."""
    if request.param != "torch" and not few_rows_kernel.available():
        pytest.skip("numba is not installed (pip install 'specdec[fast]')")
    before = set_kernel(request.param)
    yield request.param
    set_kernel(before)


@pytest.fixture(params=["mkl", "onednn"])
def each_library(request):
    """Run the test with each rule for fp32 calls (MKL's where torch has it), then restore the rule."""
    if request.param == "mkl" and not mkl_packs():
        pytest.skip("this torch has no MKL")
    before = set_fp32_library(request.param)
    yield request.param
    set_fp32_library(before)


@pytest.fixture
def mkl_rule():
    """The "mkl" rule for fp32 calls within the test, whatever this host's default, then restored."""
    before = set_fp32_library("mkl")
    yield
    set_fp32_library(before)


def _layer(bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(48, 80, bias=bias)
    use_few_rows(layer)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 48), (SMALL_ROWS, 48), (SMALL_ROWS + 1, 48), (3, 5, 48),
                                   (MAX_ROWS, 48), (1, MAX_ROWS + 1, 48), (PACKED_ROWS, 48), (PACKED_ROWS + 1, 48)])
def test_few_rows_compute_f_linear_up_to_rounding(bias, shape, each_kernel, each_library):
    layer = _layer(bias)
    assert type(layer) is FewRowsLinear
    x = torch.randn(*shape)
    with torch.no_grad():
        got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.shape == want.shape and got.is_contiguous()
    # the same sums in another order: both within fp32 rounding of the exact product
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (3, 5, 48), (MAX_ROWS, 48), (2, 100, 48)])
def test_bf16_calls_are_f_linears_bit_for_bit(shape):
    # oneDNN with a packed weight where this CPU runs its bf16 kernels, F.linear itself elsewhere:
    # either way the very bits of F.linear on the same rows, at every row count. (F.linear itself
    # rounds a strided 3-D input's product differently from the same rows made contiguous; here a
    # strided input gets the contiguous rows' bits.)
    layer = _layer(True).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)

    def want(rows):
        if not packs(torch.bfloat16):                       # F.linear's own path, whatever its strides
            return F.linear(rows, layer.weight, layer.bias)
        flat = rows.contiguous().reshape(-1, 48)
        return F.linear(flat, layer.weight, layer.bias).reshape(*rows.shape[:-1], 80)

    with torch.no_grad():
        assert torch.equal(layer(x), want(x))
        strided = x[..., 1:, :] if len(shape) > 2 else x[1:]
        assert torch.equal(layer(strided), want(strided))
    assert (layer in few_rows._packed) == packs(torch.bfloat16)


def test_a_cast_drops_the_packed_weight_of_the_dtype_before(each_library):
    # a layer packed in fp32, then cast to bf16: the fp32 pack is not kept (it is stale and as large as
    # the weight); where oneDNN runs bf16 the first bf16 call packs the bf16 weight
    layer = _layer(True)
    if layer not in few_rows._packed:
        pytest.skip("no packed fp32 product on this CPU or torch")
    layer.to(torch.bfloat16)
    assert layer not in few_rows._packed
    with torch.no_grad():
        layer(torch.randn(2, 48, dtype=torch.bfloat16))
    assert (layer in few_rows._packed) == packs(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_weight_follows_its_weight_and_stays_out_of_state_and_copies(dtype, each_library):
    if not (packs(dtype) or (dtype == torch.float32 and each_library == "mkl")):
        pytest.skip(f"oneDNN's packed {dtype} product does not run on this CPU or torch")
    layer = _layer(True).to(dtype)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(SMALL_ROWS + 3, 48, dtype=dtype)                 # above the small-row kernel: packed
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}

    def check_against_f_linear():
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **tol)

    use_few_rows(layer, False)
    use_few_rows(layer)
    assert layer in few_rows._packed                         # packed when switched: no call pays for it
    check_against_f_linear()
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in state.items())
    twin = copy.deepcopy(layer)                                      # the packed tensor could not be copied
    with torch.no_grad():
        layer.weight.mul_(-2)                                        # in place, as an optimizer step
    check_against_f_linear()
    layer.weight = nn.Parameter(torch.randn(80, 48, dtype=dtype))   # another tensor
    check_against_f_linear()
    with torch.no_grad():
        torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias), **tol)
    use_few_rows(layer, False)                                       # switched back: the packed copy goes
    assert layer not in few_rows._packed and type(layer) is nn.Linear
    with prepare_for_device(layer, "cpu", dtype=None):
        assert layer in few_rows._packed
        check_against_f_linear()
    assert layer not in few_rows._packed and type(layer) is nn.Linear


def test_calls_that_record_gradients_and_large_calls_take_torchs_own_path(each_kernel):
    layer = _layer(True)
    x = torch.randn(4, 48, requires_grad=True)
    got = layer(x)                                   # training: F.linear itself, bit for bit, with gradients
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
    got.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    big = torch.randn(PACKED_ROWS + 1, 48)
    with torch.no_grad():
        assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))
        empty = torch.randn(0, 48)
        assert layer(empty).shape == (0, 80)


def test_use_few_rows_switches_plain_linears_in_place_and_back():
    class Own(nn.Linear):                            # a subclass keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), Own(8, 2)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].weight
    assert use_few_rows(model) == 2
    assert [type(m) for m in (model[0], model[2][0], model[2][1])] == [FewRowsLinear, FewRowsLinear, Own]
    assert model[0].weight is weight                  # the same parameters, not copies
    assert use_few_rows(model) == 0                   # already switched
    assert use_few_rows(model, False) == 2 and type(model[0]) is nn.Linear
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pytest.raises(SpecdecError, match="torch module"):
        use_few_rows("model")


def test_a_numba_kernel_is_chosen_where_it_is_installed_and_a_bad_choice_is_one_line(monkeypatch):
    from specdec_models.cpu.dtypes import cpu_flags

    assert kernel() == kernel_for(cpu_flags(), few_rows_kernel.available())
    with pytest.raises(SpecdecError, match="must be one of panels, numba, torch"):
        set_kernel("mkl")
    monkeypatch.setattr(few_rows_kernel, "available", lambda: False)
    for name in ("numba", "panels"):
        with pytest.raises(SpecdecError, match=f"the {name} few-row kernel needs numba") as err:
            set_kernel(name)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(("flags", "numba", "want"), [
    ({"fpu", "sse2", "avx", "fma", "avx2"}, True, "panels"),          # a Zen 3 EPYC: the panel kernel up to 64 rows
    ({"avx2", "avx512f", "avx512_bf16"}, True, "numba"),               # a Zen 5 EPYC: numba's dot kernel, then oneDNN
    (set(), True, "numba"),                                             # no /proc/cpuinfo: the rule of before
    ({"avx2"}, False, "torch"),                                         # no numba
])
def test_the_panel_kernel_is_the_rule_with_avx2_and_without_avx512(flags, numba, want):
    assert kernel_for(frozenset(flags), numba) == want


@pytest.mark.skipif(not few_rows_kernel.available(), reason="numba is not installed")
@pytest.mark.parametrize(("env", "pool"), [({"OMP_NUM_THREADS": "1"}, 1),
                                           ({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}, 2)])
def test_numbas_pool_gets_torchs_threads_unless_numba_num_threads_is_set(env, pool):
    # a pool of every core in a one-thread process spins against its neighbours (few_rows_kernel's
    # docstring); numba reads its pool size once, at import, so each case runs in a fresh process
    import os
    import subprocess
    import sys

    code = ("import torch; from specdec_models.cpu import few_rows_kernel as k; print(torch.get_num_threads()); "
            "k.matmul_wt(torch.randn(2, 8), torch.randn(4, 8)); import numba; "
            "print(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads())")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    torch_threads, numba_pool, torch_threads_after = map(int, out.stdout.split())
    assert (torch_threads, numba_pool) == (1, pool)
    if pool == 1:          # a larger pool shares its OpenMP runtime with torch's and raised torch's threads here
        assert torch_threads_after == 1


@pytest.mark.skipif(not few_rows_kernel.available(), reason="numba is not installed")
def test_the_numba_kernel_is_what_few_row_layers_call_in_fp32_on_a_cpu(each_kernel, each_library, monkeypatch):
    # by the "onednn" rule, with the numba kernel chosen a small fp32 call goes through it, a larger
    # one too where oneDNN cannot take it; bf16, torch's kernel and MKL's rule do not
    calls = []
    real = few_rows_kernel.matmul_wt
    monkeypatch.setattr(few_rows_kernel, "matmul_wt", lambda x, w, *a: calls.append(x.shape) or real(x, w, *a))
    layer = _layer(True)
    with torch.no_grad():
        layer(torch.randn(3, 48))
        layer(torch.randn(SMALL_ROWS + 1, 48))
        layer.to(torch.bfloat16)(torch.randn(3, 48, dtype=torch.bfloat16))
    larger = [] if packs(torch.float32) else [(SMALL_ROWS + 1, 48)]
    assert calls == ([(3, 48), *larger] if each_kernel == "numba" and each_library == "onednn" else [])


@pytest.mark.skipif(not mkl_packs(), reason="this torch has no MKL")
def test_mkl_is_the_fp32_rule_on_intel_cpus_and_the_choice_is_checked(monkeypatch):
    from specdec_models.cpu.dtypes import cpu_vendor

    assert fp32_library() == ("mkl" if cpu_vendor() == "GenuineIntel" else "onednn")
    for bad, match in (("blas", "must be one of mkl, onednn"), ("mkl", "needs a torch built with MKL")):
        if bad == "mkl":
            monkeypatch.setattr(few_rows, "mkl_packs", lambda: False)
        with pytest.raises(SpecdecError, match=match) as err:
            set_fp32_library(bad)
        assert "\n" not in str(err.value)


@pytest.mark.skipif(not mkl_packs(), reason="this torch has no MKL")
def test_by_the_mkl_rule_up_to_3_rows_are_f_linear_and_4_to_64_mkls_packed_product(monkeypatch, mkl_rule):
    calls = []
    real = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(few_rows, "_MKL_LINEAR", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    layer = _layer(True)
    with torch.no_grad():
        for rows in (1, LINEAR_ROWS, LINEAR_ROWS + 1, PACKED_ROWS, PACKED_ROWS + 1):
            x = torch.randn(rows, 48)
            got = layer(x)
            if rows <= LINEAR_ROWS or rows > PACKED_ROWS:        # torch's own kernel: its very bits
                assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [LINEAR_ROWS + 1, PACKED_ROWS]


@pytest.mark.skipif(not mkl_packs(), reason="this torch has no MKL")
def test_mkls_layout_is_checked_per_shape_and_a_failed_shape_takes_the_other_rule(monkeypatch, mkl_rule):
    # the check can fail: a layout packed from another weight of the same shape gives other sums
    monkeypatch.setattr(few_rows, "_mkl_shapes", {})
    w, other = torch.randn(80, 48), torch.randn(80, 48)
    assert few_rows._mkl_layout_checked(w, torch.ops.mkl._mkl_reorder_linear_weight(w, PACKED_ROWS))
    few_rows._mkl_shapes.clear()
    assert not few_rows._mkl_layout_checked(w, torch.ops.mkl._mkl_reorder_linear_weight(other, PACKED_ROWS))
    assert few_rows._mkl_shapes == {(80, 48): False}
    # a shape that failed computes by the "onednn" rule, right, and is not packed for MKL again
    layer = _layer(True)
    for rows in (1, SMALL_ROWS + 1, PACKED_ROWS):
        x = torch.randn(rows, 48)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    if kernel() == "panels":                         # every row count: the panel kernel's packed weight
        assert few_rows._packed[layer][2] == "panels"
    elif packs(torch.float32):                       # 5 and 64 rows: oneDNN's packed weight
        assert few_rows._packed[layer][2] == "onednn"


def test_the_rule_is_fp32_on_a_cpu_and_bf16_where_onednn_runs_it_and_a_piece_off_is_checked(monkeypatch):
    assert few_rows_pays("cpu", torch.float32) and few_rows_pays(torch.device("cpu"), torch.float32)
    assert few_rows_pays("cpu", torch.bfloat16) == packs(torch.bfloat16)
    assert not few_rows_pays("cuda", torch.float32) and not few_rows_pays("cuda", torch.bfloat16)
    assert not few_rows_pays("cpu", torch.float16)

    def switched(dtype: torch.dtype) -> bool:            # does prepare_for_device switch a layer of this dtype
        layer = nn.Linear(48, 80).to(dtype)
        with prepare_for_device(layer, "cpu", dtype=None) as prepared:
            return type(layer) is FewRowsLinear and prepared.layers == [layer]

    assert switched(torch.float32)
    assert switched(torch.bfloat16) == packs(torch.bfloat16)
    with pieces_off({"linear"}):                       # a benchmark's "off": torch's own layers
        assert not switched(torch.float32) and not switched(torch.bfloat16)
    assert switched(torch.float32)
    monkeypatch.setitem(few_rows._packs, torch.bfloat16, False)      # a CPU without oneDNN's bf16 kernels
    assert not few_rows_pays("cpu", torch.bfloat16) and not switched(torch.bfloat16)
    with pytest.raises(SpecdecError, match="no piece yes") as err:
        with pieces_off({"yes"}):
            pass
    assert "\n" not in str(err.value)


def test_greedy_decoding_through_few_row_layers_is_the_targets_own(tmp_path, each_kernel, each_library):
    # a tiny Llama target and an eagle3 head, both switched: chain and tree decoding emit what
    # transformers' generate() emits with torch's own layers
    pytest.importorskip("transformers")
    from test_eagle3 import head_for
    from test_hf_decode import build, hf_greedy, ragged_prompts

    from specdec_models.decode import GREEDY, HeadDrafter, TreeDrafter, TreeSpec, generate

    model = build(tmp_path / "llama", "llama", 1, 30.0)
    head = head_for(model, draft=60, layers=[1, 2, 0])
    prompts = ragged_prompts()
    alone, _ = hf_greedy(model, prompts, 12)
    assert use_few_rows(model) > 0 and use_few_rows(head) > 0
    for drafter in (None, HeadDrafter(head), TreeDrafter(head, TreeSpec(3, 2, 2, 3))):
        got, _ = generate(model, prompts, 12, drafter, sampling=GREEDY, gamma=3)
        assert [t.tolist() for t in got] == alone, drafter


def test_reports_name_the_path_each_dtype_takes(monkeypatch, each_kernel, each_library):
    small = "numba's kernel" if each_kernel == "numba" else "W @ x.T"
    if each_library == "mkl":
        want = f"F.linear up to {LINEAR_ROWS} rows, MKL with packed weights up to {PACKED_ROWS}"
        assert describe(torch.float32) == want
        return
    if each_kernel == "panels":
        assert describe(torch.float32) == f"numba's panel kernel up to {PACKED_ROWS} rows"
        return
    for packed in (True, False):
        monkeypatch.setitem(few_rows._packs, torch.bfloat16, packed)
        monkeypatch.setitem(few_rows._packs, torch.float32, packed)
        assert describe(torch.bfloat16) == ("oneDNN with packed weights" if packed else
                                            "F.linear (oneDNN cannot run bf16 here)")
        assert describe(torch.float32) == (f"{small} up to {SMALL_ROWS} rows, oneDNN with packed weights up to "
                                           f"{PACKED_ROWS}" if packed else f"{small} up to {MAX_ROWS} rows")


@pytest.mark.parametrize(("flags", "rows"), [
    ({"fpu", "sse2", "avx", "fma", "avx2"}, 10),                        # a Zen 3 EPYC: numba's kernel up to 10
    ({"avx2", "avx512f", "avx512_bf16"}, 4),                             # a Zen 5 EPYC: oneDNN from 5
    ({"avx2", "avx512f"}, 4),
    (set(), 4),                                                          # no /proc/cpuinfo: the rule of before
])
def test_the_small_row_kernel_serves_more_rows_without_avx512(flags, rows):
    assert small_rows_for(frozenset(flags)) == rows
    assert 1 <= rows < PACKED_ROWS and rows <= MAX_ROWS


def test_the_host_rule_picks_numba_below_and_onednn_above_small_rows(monkeypatch):
    """Each side of this host's SMALL_ROWS takes its own path (numba's kernel, then oneDNN's packed weight)."""
    if not (few_rows_kernel.available() and packs(torch.float32)):
        pytest.skip("needs numba and oneDNN's packed fp32 product")
    monkeypatch.setattr(few_rows, "_library", "onednn")
    monkeypatch.setattr(few_rows, "_kernel", "numba")
    numba_rows, packed_rows = [], []
    real_numba, real_packed = few_rows_kernel.matmul_wt, few_rows._packed_linear
    monkeypatch.setattr(few_rows_kernel, "matmul_wt",
                        lambda x, w, *a: numba_rows.append(x.shape[0]) or real_numba(x, w, *a))
    monkeypatch.setattr(few_rows, "_packed_linear",
                        lambda layer, x: packed_rows.append(x.shape[0]) or real_packed(layer, x))
    layer = nn.Linear(48, 24)
    use_few_rows(layer)
    with torch.no_grad():
        for rows in (1, SMALL_ROWS, SMALL_ROWS + 1):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert numba_rows == [1, SMALL_ROWS] and packed_rows == [SMALL_ROWS + 1]


def test_set_small_rows_moves_the_line_and_refuses_bad_counts(monkeypatch):
    monkeypatch.setattr(few_rows, "SMALL_ROWS", few_rows.SMALL_ROWS)          # restored after the test
    before = set_small_rows(6)
    assert few_rows.SMALL_ROWS == 6 and set_small_rows(before) == 6 and few_rows.SMALL_ROWS == before
    for bad in (0, MAX_ROWS + 1, 2.5, True, "4"):
        with pytest.raises(SpecdecError, match="small-row kernel's rows"):
            set_small_rows(bad)
    assert few_rows.SMALL_ROWS == before


@pytest.mark.skipif(not few_rows_kernel.available(), reason="numba is not installed")
@pytest.mark.parametrize(("out", "inp"), [(80, 48), (37, 5), (16, 1), (3, 130)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 64])
def test_the_panel_kernel_is_the_exact_product_up_to_fp32_rounding(out, inp, rows):
    # every tile height (1-6 rows and their sums), outputs padded to whole panels of 16 and dropped
    from specdec_models.cpu import few_rows_panels

    g = torch.Generator().manual_seed(rows * 1000 + out)
    w, x = torch.randn(out, inp, generator=g), torch.randn(rows, inp, generator=g)
    packed = few_rows_panels.pack(w)
    assert packed.shape == (-(-out // 16), inp, 16)
    got = few_rows_panels.matmul_panels(x, packed, out)
    assert got.shape == (rows, out) and got.is_contiguous()
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    shaped = few_rows_panels.matmul_panels(x, packed, out, (1, rows, out))
    assert shaped.shape == (1, rows, out) and torch.equal(shaped[0], got)


@pytest.mark.skipif(not few_rows_kernel.available(), reason="numba is not installed")
def test_the_panel_rule_takes_every_fp32_call_up_to_packed_rows_and_f_linear_above(monkeypatch):
    from specdec_models.cpu import few_rows_panels

    monkeypatch.setattr(few_rows, "_library", "onednn")
    monkeypatch.setattr(few_rows, "_kernel", "panels")
    calls = []
    real = few_rows_panels.matmul_panels
    monkeypatch.setattr(few_rows_panels, "matmul_panels", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    compiled = []
    real_compile = few_rows_panels.compile_kernel
    monkeypatch.setattr(few_rows_panels, "compile_kernel", lambda: compiled.append(1) or real_compile())
    layer = _layer(True)
    assert few_rows._packed[layer][2] == "panels" and compiled         # packed and compiled when switched
    with torch.no_grad():
        for rows in (1, SMALL_ROWS + 1, PACKED_ROWS, PACKED_ROWS + 1):
            x = torch.randn(rows, 48)
            got, want = layer(x), F.linear(x, layer.weight, layer.bias)
            if rows > PACKED_ROWS:                                     # torch's own kernel: its very bits
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        layer.to(torch.bfloat16)(torch.randn(3, 48, dtype=torch.bfloat16))   # bf16: not the fp32 kernel
    assert calls == [1, SMALL_ROWS + 1, PACKED_ROWS]


def test_matmul_costs_time_every_few_row_path_over_the_models_weights():
    from specdec_models.cpu.timing import matmul_costs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80), nn.Linear(80, 48, bias=False))
    costs = matmul_costs(model, [1, 5], repeats=2)
    want = {"F.linear"} | ({"numba", "panels"} if few_rows_kernel.available() else set())
    want |= ({"onednn"} if packs(torch.float32) else set()) | ({"mkl"} if mkl_packs() else set())
    assert set(costs) == want
    assert all(set(c) == {1, 5} and all(v > 0 for v in c.values()) for c in costs.values())
    with pytest.raises(SpecdecError, match="fp32 model"):
        matmul_costs(copy.deepcopy(model).to(torch.bfloat16), [1])
    with pytest.raises(SpecdecError, match="integers >= 1"):
        matmul_costs(model, [0])
