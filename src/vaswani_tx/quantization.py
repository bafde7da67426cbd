"""int8 CPU inference: dynamic quantization of the model's linear layers.

    from vaswani_tx.quantization import quantize_int8
    model = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(folder))
    model.generate(...)

Every `nn.Linear` (the attention projections W^Q, W^K, W^V, W^O of Section 3.2.2, the two layers of
the feed-forward network of Section 3.3, and the pre-softmax projection of Section 3.4) gets int8
weights, one scale per output row, and int8 activations with a scale computed from each input on the
fly ("dynamic"); the products accumulate in int32 and come back as float32. Embeddings, LayerNorm,
softmax and the positional encodings stay float32, so the shared embedding is kept in full precision
for the lookups while the pre-softmax projection uses its own int8 copy.

This uses ``torch.ao.quantization.quantize_dynamic`` (fbgemm/x86 kernels), which PyTorch marks
deprecated in favour of torchao; it is the int8 path that works in stock PyTorch on CPU today, and
its deprecation warnings are silenced here rather than shown to every user. The quantized layers
become :class:`Int8Linear`, the same module with a shorter forward (same kernel, same output) that
also holds the same int8 weights packed for oneDNN, whose kernels use AMX tiles where the CPU has them: there,
from about 32 rows up (beam search over a batch) they are faster than fbgemm's, several times at the
pre-softmax projection, while fbgemm's stay faster on a few rows; without AMX (AVX512-VNNI) oneDNN's pay from
32 rows at the pre-softmax projection only, and the other layers keep fbgemm's below 384 rows (docs/speed.md,
benchmarks/bench_int8_kernels.py).
On CPUs with AVX512-VNNI, where the model's folder holds the int8 few-rows kernel (`vaswani-tx compile`, int8_rows.py),
products of up to 32 rows (16 for a layer of more than 8M weights) are that kernel's instead, on the same int8
weights with the activations quantized a row at a time (a sentence a call, beam search over one source: 1.2-2.5x
fbgemm's speed at 6 rows, 1.1-1.7x at 24-32, docs/speed.md); where the CPU has no AMX tiles, products of any number
of rows (but the pre-softmax projection's past 32 and a large layer's past 16), ahead of fbgemm's there at every
number measured.
The quantized model is for inference only (no gradients) and is not saved with ``save_pretrained``:
quantize after loading. ``benchmarks/bench_int8_bleu.py`` measures what int8 costs in BLEU and
gains in speed against the float32 model.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear  # imported by torch itself already

from vaswani_tx import int8_rows
from vaswani_tx.errors import UserInputError
from vaswani_tx.precision import cpu_bf16_instructions


def quantize_int8(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Return `model` with int8 dynamically quantized linear layers, in eval mode (a copy unless `inplace`).

    Raises ValueError for a model that is not float32 (quantization starts from float32 weights), and
    UserInputError on a machine whose torch has no int8 engine (decode without int8 there).
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(
            f"quantize_int8 needs a float32 model; this one has parameters of {sorted(map(str, dtypes))}."
        )
    if torch.backends.quantized.engine not in ("fbgemm", "x86", "onednn", "qnnpack"):
        raise UserInputError(
            f"no int8 engine on this machine (torch.backends.quantized.engine={torch.backends.quantized.engine!r}): "
            "decode without int8 (--int8) here"
        )
    if not inplace:
        # the float32 model's compiled decoding step does not serve int8: the copy goes without it (and loads the
        # folder's int8 step below, where there is one)
        model = copy.deepcopy(model, memo={id(getattr(model, "_compiled_step", None)): None})
    model.eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao\..*")
        warnings.filterwarnings("ignore", message=r".*(deprecated|torchao).*")
        quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    # the pre-softmax projection keeps oneDNN's kernel from MANY_ROWS on every CPU; a module other than a model
    # (a benchmark's single layer) has none
    projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    amx = cpu_bf16_instructions() == "AMX"
    for module in model.modules():
        if type(module) is DynamicQuantizedLinear:
            module.__class__ = Int8Linear
            module.many_rows_params = _onednn_packing(module)
            if not amx and module is not projection:
                module.many_rows = Int8Linear.MANY_ROWS_WITHOUT_AMX
    # the float32 step cannot serve int8 layers: a folder's int8 step (`vaswani-tx compile`) takes its place, if any,
    # and its int8 few-rows kernel the layers' products of a few rows
    folder = getattr(model, "_compiled_folder", None)
    if folder is not None and int8_rows.load(folder):
        use_rows_kernel(model)
    if folder is not None:
        from vaswani_tx.compiled_decoding import attach

        attach(model, folder)
    return model


def _onednn_packing(module: DynamicQuantizedLinear):
    """The module's int8 weights and bias packed for oneDNN's kernel, or None where torch has no oneDNN
    engine or it cannot pack for it (the layer then runs on fbgemm's packing alone, as before). Packing follows
    the global engine, hence the switch around it."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        return None
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "onednn"
        return torch.ops.quantized.linear_prepack(module.weight(), module.bias())
    except RuntimeError:
        return None
    finally:
        torch.backends.quantized.engine = engine


class Int8Linear(DynamicQuantizedLinear):
    """torch's dynamically quantized Linear with a shorter `forward`: the int8 kernel's overload called
    directly. A decoding step makes some 50 of these calls on a handful of rows, where the stock
    forward's version and dtype checks and the operator packet's Python dispatch are a measurable part
    of the step. Below `many_rows` rows: the same kernel, the same arguments (per-row weight scales, the
    `reduce_range` of the module's version 4), the same output.

    From `many_rows` rows up it calls the same kernel on `many_rows_params`, the same int8 weights packed
    for oneDNN (see the module docstring): the same weights and the same kind of activation scale, so the
    two agree to within the quantization's own error (an activation may round to the neighbouring int8
    value), not bit for bit.

    Where the model's folder has the int8 few-rows kernel (int8_rows.py), products of up to
    `int8_rows.rows_limit` rows (32 where the CPU has AMX tiles or for the pre-softmax projection, any number
    otherwise, 16 for a large layer) are the kernel's, on the same int8 weights: one activation scale a row, not one
    a call, so those too agree with the others to within the quantization's own error.

    A product of more than `SCALE_ROWS` rows is one call a block of that many rows, each block's activations with
    their own scale (the kernels take one a call), so that rows far apart in a batch do not share one."""

    _kernel = torch.ops.quantized.linear_dynamic.default
    # Where oneDNN overtakes fbgemm on one thread (bench_int8_kernels.py, docs/speed.md): at the base shape's layers
    # from 32 rows on a CPU with AMX tiles (an Intel Xeon); without them (AVX512-VNNI, an AMD EPYC Zen 4) only the
    # pre-softmax projection's from 32 rows, the attention and feed-forward layers' from 128-384 (at 32 rows
    # oneDNN's take 1.2-1.5x fbgemm's time there), so those keep fbgemm's below MANY_ROWS_WITHOUT_AMX.
    MANY_ROWS = 32
    MANY_ROWS_WITHOUT_AMX = 384
    many_rows = MANY_ROWS  # this layer's (`quantize_int8` sets it by CPU and layer)
    many_rows_params = None
    # Where the model's folder has the int8 few-rows kernel (int8_rows.py), its copy of the same int8 weights
    # (`int8_rows.attach_weights`'s buffers) takes products of up to `int8_rows.rows_limit` rows, the activations
    # quantized a row at a time; and every product while a step that calls it is exported (`rows_calls`).
    rows_always = False

    rows_kernel_elements = 0  # inputs of up to this many elements take the kernel (`int8_rows.attach_weights`)
    # fbgemm's and oneDNN's kernels quantize a call's activations with one scale, set by its largest |x|: over a
    # batch's encoder input (thousands of rows) one sentence's outlier then coarsens every other's rounding, and a
    # sentence's translation depends on the batch it came in. So a product of more rows takes one call a block of
    # SCALE_ROWS rows, each with its own scale (CTranslate2 scales each row). Blocks of 1,024 rows took a pass
    # within the noise of one call; smaller ones cost more (Multi30k val in batches of 4,096 source tokens, beam 4,
    # one thread: 256 rows +13%), docs/speed.md.
    SCALE_ROWS = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "rows_packed" in self._buffers and (x.numel() <= self.rows_kernel_elements or self.rows_always):
            return int8_rows.linear(self, x)
        if x.numel() > self.SCALE_ROWS * self.in_features:  # each block goes as a call of its own rows would
            rows = x.reshape(-1, self.in_features)
            out = rows.new_empty(rows.shape[0], self.out_features)
            for start in range(0, rows.shape[0], self.SCALE_ROWS):
                out[start : start + self.SCALE_ROWS] = self.forward(rows[start : start + self.SCALE_ROWS])
            return out.view(*x.shape[:-1], self.out_features)
        if self.many_rows_params is not None and x.numel() >= self.many_rows * self.in_features:
            return self._kernel(x, self.many_rows_params, True)
        return self._kernel(x, self._packed_params._packed_params, True)


def use_rows_kernel(model: nn.Module) -> None:
    """Give each of the model's int8 layers its weights for the int8 few-rows kernel (loaded: `int8_rows.load`)."""
    projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if type(module) is Int8Linear:
            int8_rows.attach_weights(module, projection=module is projection)


@contextlib.contextmanager
def rows_calls(model: nn.Module):
    """While the block runs, every int8 layer of `model` with the kernel's weights takes the kernel for any number of
    rows, and holds no fbgemm packing (a TorchBind object, which `torch.export` cannot take): the int8 few-rows step
    is exported so (compile_step.py), a graph of the kernel's calls on the layers' buffers."""
    layers = [module for module in model.modules() if type(module) is Int8Linear]
    packings = [
        (module._modules.pop("_packed_params"), module.__dict__.pop("many_rows_params", None)) for module in layers
    ]
    Int8Linear.rows_always = True
    try:
        yield
    finally:
        Int8Linear.rows_always = False
        for module, (fbgemm, onednn) in zip(layers, packings):
            module._modules["_packed_params"] = fbgemm
            module.many_rows_params = onednn


def is_quantized_int8(model: nn.Module) -> bool:
    """Whether `model` holds dynamically quantized int8 linear layers (from :func:`quantize_int8`)."""
    return any(isinstance(module, DynamicQuantizedLinear) for module in model.modules())
