"""The int8 few-rows kernel (int8_rows.py, kernels/int8_rows.cpp): its arithmetic, where the int8 layers take it,
and the folders it is not used from."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from test_fast_decoding import screen_model
from vaswani_tx import fast_decoding, int8_rows
from vaswani_tx.compiled_decoding import native_folder
from vaswani_tx.errors import UserInputError
from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.quantization import Int8Linear, quantize_int8

SUPPORTED, WHY = int8_rows.cpu_supports()
needs_kernel = pytest.mark.skipif(
    not SUPPORTED or shutil.which("g++") is None, reason=f"the kernel does not run here: {WHY or 'no g++'}"
)


def quantized_linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> Int8Linear:
    torch.manual_seed(seed)
    layer = nn.Sequential(nn.Linear(in_features, out_features, bias=bias))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_int8(layer)[0]


def python_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in torch: rows quantized symmetrically, products of the int8 values."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rows = torch.round(x * (1 / scale)).clamp(-127, 127)
    out = (rows.double() @ weight.int_repr().double().t()).float() * (scale * weight.q_per_channel_scales().float())
    return out if bias is None else out + bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(64, 48, True), (30, 100, True), (256, 37, False)])
def test_the_kernel_computes_its_quantization_exactly(kernel_folder, rows, in_features, out_features, bias):
    """Rows quantized symmetrically to int8 (one scale a row), int32 products with the layer's own int8 weights,
    scaled back: the kernel gives what torch computes from the same int8 values, for row counts below, at and past
    its register block of 8, K not a multiple of 4 and N not a multiple of 16, with and without a bias, a zero row
    included (its scale is 1, its output the bias)."""
    layer = quantized_linear(in_features, out_features, bias)
    int8_rows.attach_weights(layer)
    weight, bias_tensor = layer._packed_params._weight_bias()
    x = torch.randn(rows, in_features) * 3
    x[0] = 0.0
    ours = int8_rows.linear(layer, x)
    expected = python_reference(x, weight, bias_tensor)
    assert ours.shape == (rows, out_features)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)
    # within int8's error of the float32 product (the layer's own weights, dequantized)
    exact = x @ weight.dequantize().t() + (bias_tensor if bias_tensor is not None else 0)
    assert (ours - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernel
def test_the_kernels_shift_sums_are_each_columns_sum_times_128(kernel_folder):
    """What the unsigned shift adds to each accumulator: a column's int8 sum times 128, in int32, exact at the
    extremes (K x 127 x 128), for any layout of W."""
    torch.manual_seed(0)
    weight = torch.randint(-127, 128, (37, 515), dtype=torch.int8)
    weight[0], weight[1], weight[2] = 127, -127, 0
    expected = (weight.long().sum(1) * 128).int()
    for w in (weight, weight.t().contiguous().t()):
        sums = torch.ops.vaswani_tx_int8.shift_sums(w)
        assert sums.dtype == torch.int32 and torch.equal(sums, expected)
    assert int(expected[0]) == 515 * 127 * 128


@needs_kernel
@pytest.mark.parametrize(
    "shape", [(2, 3, 256), (70, 1024)], ids=["3-d input, strided", "more rows than the thread's kept buffer"]
)
def test_the_kernel_takes_any_layout_and_many_rows(kernel_folder, shape):
    """An input that is not contiguous (copied first) keeps its leading dimensions in the output; a call whose
    quantized rows outgrow the buffer each thread keeps (64 KiB) uses one of its own, with the same arithmetic."""
    layer = quantized_linear(shape[-1], 40, bias=True)
    int8_rows.attach_weights(layer)
    weight, bias_tensor = layer._packed_params._weight_bias()
    x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2] * 3  # every other column: a strided view
    ours = int8_rows.linear(layer, x)
    assert ours.shape == (*shape[:-1], 40)
    expected = python_reference(x.reshape(-1, shape[-1]), weight, bias_tensor).reshape(*shape[:-1], 40)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)
    # a small call after the large one reads the kept buffer again
    torch.testing.assert_close(int8_rows.linear(layer, x[:1]), expected[:1], rtol=1e-6, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("instructions", ["AMX", "AVX512-BF16"], ids=["amx", "without-amx"])
def test_int8_layers_take_the_kernel_up_to_few_rows_and_their_own_kernel_past_them(
    kernel_folder, tmp_path, monkeypatch, instructions
):
    """A model quantized from a folder with the kernel: every int8 layer has its weights for it. Where the CPU has AMX
    tiles a product of up to `FEW_ROWS` rows is the kernel's (3-D inputs too), one of more rows the layer's own
    packing, as before; without them every product is the kernel's. A large layer (more than `LARGE_LAYER` weights:
    made small here) takes it up to the few-rows step's 16 rows only, on either; the pre-softmax projection up to
    `FEW_ROWS` on either."""
    model = VaswaniForConditionalGeneration(_tiny_config())
    model.save_pretrained(tmp_path / "model")
    shutil.copytree(kernel_folder / int8_rows.FOLDER, native_folder(tmp_path / "model") / int8_rows.FOLDER)
    monkeypatch.setattr(int8_rows, "LARGE_LAYER", 40 * 32 - 1)  # the tiny model's pre-softmax projection (32 -> 40)
    monkeypatch.setattr(int8_rows, "cpu_bf16_instructions", lambda: instructions)
    quantized = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(tmp_path / "model"))
    layers = [module for module in quantized.modules() if type(module) is Int8Linear]
    assert layers and all("rows_packed" in module._buffers for module in layers)
    every = instructions != "AMX"
    for layer, limit in ((layers[0], int8_rows.FEW_ROWS), (quantized.get_output_embeddings(), 16)):
        large = layer is quantized.get_output_embeddings()
        assert layer.rows_kernel_elements == (int8_rows.ALL_ROWS if every and not large else limit) * layer.in_features
        weight, bias = layer._packed_params._weight_bias()
        few = torch.randn(2, limit // 2, layer.in_features)
        torch.testing.assert_close(layer(few), python_reference(few, weight, bias), rtol=1e-6, atol=1e-5)
        if every and not large:  # the kernel's, one scale a row, past SCALE_ROWS rows too (no blocks of them)
            many = torch.randn(Int8Linear.SCALE_ROWS + 3, layer.in_features)
            torch.testing.assert_close(layer(many), python_reference(many, weight, bias), rtol=1e-6, atol=1e-5)
            continue
        many = torch.randn(limit + 1, layer.in_features)
        # past the kernel's rows, the layer's own packing for that many rows: oneDNN's from `many_rows` on (where a
        # CPU has AMX tiles, from 32 rows), fbgemm's below
        onednn = layer.many_rows_params is not None and many.shape[0] >= layer.many_rows
        packing = layer.many_rows_params if onednn else layer._packed_params._packed_params
        assert torch.equal(layer(many), torch.ops.quantized.linear_dynamic(many, packing, True))
    monkeypatch.setattr(int8_rows, "LARGE_LAYER", 1 << 23)
    projection = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(tmp_path / "model"))
    projection = projection.get_output_embeddings()
    assert projection.rows_kernel_elements == int8_rows.FEW_ROWS * projection.in_features
    ids = torch.tensor([[5, 6, 7, 8, 3]])
    out = quantized.generate(input_ids=ids, num_beams=3, max_new_tokens=6)
    assert out.shape[0] == 1 and out.shape[1] <= 7


def _tiny_config():
    from vaswani_tx.configuration_vaswani import VaswaniConfig

    return VaswaniConfig(
        vocab_size=40, d_model=32, d_ff=64, num_heads=4, d_k=8, d_v=8, num_encoder_layers=2, num_decoder_layers=2
    )


def in_a_fresh_process(statement: str, folder) -> tuple[str, list[str]]:
    """Run `statement` (Python, `sys` imported, the folder as sys.argv[1]) in a new process with warnings logged, where
    nothing of ours is loaded yet: (what it printed, the lines it logged)."""
    code = "import logging, sys; logging.basicConfig(level=logging.WARNING);" + statement
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr.strip().splitlines()


@needs_kernel
def test_a_kernel_of_another_torch_or_source_is_one_line_and_fbgemm(kernel_folder, tmp_path):
    """A folder whose kernel was built for another torch, or from another version of the source, is not loaded: one
    logged line, and the layers keep fbgemm's kernel (in a fresh process, where nothing is loaded yet)."""
    for field, value in (("torch", "0.0.0"), ("source", "0" * 64)):
        folder = tmp_path / field
        shutil.copytree(kernel_folder / int8_rows.FOLDER, folder / int8_rows.FOLDER)
        manifest = folder / int8_rows.FOLDER / int8_rows.MANIFEST
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), field: value}))
        printed, logged = in_a_fresh_process(
            "from vaswani_tx import int8_rows; print(int8_rows.load(sys.argv[1]))", folder
        )
        assert printed == "False"
        lines = [line for line in logged if "int8 few-rows kernel" in line]
        assert len(lines) == 1
        assert ("built for torch 0.0.0" if field == "torch" else "another version of its source") in lines[0]


@needs_kernel
def test_greedy_searchs_screen_asks_quietly(kernel_folder, tmp_path, caplog):
    """Greedy search's screen asks a float32 model's folder for the kernel (`load(quiet=True)`): a kernel that does
    not fit is logged at debug level only, since the float32 model loses nothing by it (the screen keeps torch's
    int8 product), where an int8 model's warning stands."""
    folder = tmp_path / "other-torch"
    shutil.copytree(kernel_folder / int8_rows.FOLDER, folder / int8_rows.FOLDER)
    manifest = folder / int8_rows.FOLDER / int8_rows.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "torch": "0.0.0"}))
    with caplog.at_level(logging.DEBUG, logger="vaswani_tx.compiled_decoding"):
        assert not int8_rows.load(folder, quiet=True)
    assert [record.levelno for record in caplog.records] == [logging.DEBUG]
    assert "built for torch 0.0.0" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not int8_rows.load(folder)
    assert len(caplog.records) == 1


# --- greedy search's int8 screen through the kernel (fast_decoding.ScreenedArgmax) --------------------------------


@needs_kernel
def test_the_kernels_screen_product_is_within_the_screens_bound(kernel_folder):
    """With the kernel loaded, the screen's int8 product is the kernel's on its own copy of W, the rows quantized
    to int8: each logit within `ScreenedArgmax.bounds` (rounded None) of the float32 logit (float64 sums) at many
    scales and a zero row, and |x^ - x| within the bound's shift for the kernel's own quantization."""
    model = screen_model(seed=9)
    screen = fast_decoding.ScreenedArgmax.of(model, 1)
    if screen is None:
        pytest.skip(f"no int8 screen on this CPU (capability {torch.backends.cpu.get_cpu_capability()})")
    assert screen.rows_kernel is not None and screen.quantized is None  # one copy: the kernel's
    weight = screen.weight.detach()
    assert fast_decoding._rounding_within_bound(screen, columns=weight.shape[0])
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 1e3):
        rows = torch.randn(fast_decoding.SCREEN_MAX_ROWS, weight.shape[1], generator=g) * scale
        rows[0] = 0.0
        rounded, screened = screen.screened_logits(rows)
        assert rounded is None
        exact = rows.double() @ weight.double().t()
        slack = screen.bounds(rows, None, screened).double()
        assert bool(((screened.double() - exact).abs() <= slack).all()), scale
        row_scale = rows.abs().amax(1, keepdim=True) / 127
        row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
        x_hat = torch.round(rows * (1 / row_scale)).clamp(-127, 127) * row_scale
        shift = rows.abs().amax(1) * (weight.shape[1] ** 0.5 / 127 * (1 + 1e-4) / 2)
        assert bool(((x_hat - rows).norm(dim=1) <= shift).all()), scale
    # A row with one large value (a coarse int8 step for the others) and a column of W along its rounding error:
    # there the rows' rounding is most of the error, which only the bound's shift term covers.
    row = torch.randn(1, weight.shape[1], generator=g)
    row[0, 0] = 100.0
    step = row.abs().amax() / 127
    error = torch.round(row * (1 / step)).clamp(-127, 127) * step - row
    aligned = weight.clone()
    aligned[0] = error[0] / error.norm() * weight[1:].norm(dim=1).mean()
    screen = fast_decoding.ScreenedArgmax(aligned)
    _, screened = screen.screened_logits(row)
    exact = float(row.double() @ aligned[0].double())
    slack = screen.bounds(row, None, screened)[0, 0]
    shift_term = float(row.abs().amax() * (weight.shape[1] ** 0.5 / 127 * (1 + 1e-4) / 2)) * screen.norm
    assert abs(float(screened[0, 0]) - exact) <= float(slack)
    assert abs(float(screened[0, 0]) - exact) > float(slack) - shift_term  # without the shift term: outside


@needs_kernel
def test_a_kernel_whose_product_rounds_beyond_the_bound_gives_no_screen(kernel_folder, monkeypatch):
    product = torch.ops.vaswani_tx_int8.linear
    monkeypatch.setattr(torch.ops.vaswani_tx_int8, "linear", lambda *args: product(*args) * 2)
    assert fast_decoding.ScreenedArgmax.of(screen_model(seed=10), 1) is None


def test_a_folder_without_a_kernel_says_nothing(tmp_path, caplog):
    """A folder compiled without the kernel (`--no-int8`, another CPU, an earlier version): its models keep fbgemm's
    kernel, even in a process that loaded the kernel for another folder, and nothing is logged."""
    with caplog.at_level(logging.WARNING):
        assert not int8_rows.load(tmp_path)
    assert not caplog.records


def test_a_cpu_without_the_instructions_builds_no_kernel(tmp_path, monkeypatch):
    """Where the CPU lacks AVX512-VNNI, `build` (what `vaswani-tx compile` runs) refuses, naming what is missing, and
    writes nothing."""
    monkeypatch.setattr(int8_rows, "cpu_supports", lambda: (False, "this CPU lacks avx512_vnni"))
    with pytest.raises(UserInputError, match="lacks avx512_vnni"):
        int8_rows.build(tmp_path)
    assert not (tmp_path / int8_rows.FOLDER).exists()


def test_a_failing_compiler_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(int8_rows, "cpu_supports", lambda: (True, ""))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(UserInputError, match="false failed"):
        int8_rows.build(tmp_path)
    assert not (tmp_path / int8_rows.FOLDER).exists()
