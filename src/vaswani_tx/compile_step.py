"""Compiling the decoding step ahead of time (AOTInductor): what `vaswani-tx compile MODEL` runs.

The step is the model's own decoder `forward` over the keys and values of a cache (static_decoding.py's
slot views), exported with `torch.export` for any number of sources, rows per source (beams), source
length and prefix length, and compiled into `MODEL/compiled` (compiled_decoding.py loads and runs it). It
stays in the package rather than travelling with saved weights: only loading needs to.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from . import int8_rows, one_source_beams
from .atomic import atomic_folder, sigterm_as_interrupt
from .compiled_decoding import (
    ENCODER_FOLDER,
    FEW_ROWS_FOLDERS,
    FEW_ROWS_MAXIMA,
    FEW_ROWS_WEIGHTS,
    FORMAT,
    MANIFEST,
    PACKAGE,
    PRECISIONS,
    TABLE,
    architecture_fingerprint,
    file_sha256,
    gemm_backend,
    has_rows_kernel,
    int8_layers,
    int8_operator,
    int8_signature,
    machine,
    native_folder,
    precision,
    step_tensors,
    weights_fingerprint,
)
from .errors import UserInputError
from .fast_decoding import OneDNNForward, forwards_installed
from .quantization import rows_calls, use_rows_kernel
from .static_decoding import _Slots


class DecoderStep(nn.Module):
    """One decoding step over tensors only, the function that is exported and compiled.

    tokens (G, k): this position's input token of each of the k rows of G sources; self_keys/self_values,
    per layer, (P + 1, G, k, h, d): the self-attention's keys and values of the P positions so far and a slot
    for this one, which the step writes; cross_keys/cross_values, per layer, (G, h, S, d), once per source;
    sources (G, S, D) the encoder output and source_mask (G, S). Returns the decoder's output (G * k, D).
    `embedded`: the step takes the tokens' rows of the embedding matrix (G, k, D) in place of their ids (the few-rows
    step, whose weights are compiled into it: the matrix, shared with the projection, stays the model's own)."""

    def __init__(self, model: nn.Module, embedded: bool = False):
        super().__init__()
        self.model, self.embedded = model, embedded

    def forward(self, tokens, self_keys, self_values, cross_keys, cross_values, sources, source_mask):
        def rows(slots):
            return [slot.flatten(1, 2) for slot in slots]  # (P + 1, G * k, h, d): views, written in place

        cache = _Slots(rows(self_keys), rows(self_values), list(cross_keys), list(cross_values))
        inputs = (
            {"inputs_embeds": tokens.flatten(0, 1)[:, None]} if self.embedded else {"input_ids": tokens.reshape(-1, 1)}
        )
        hidden = self.model.get_decoder()(
            **inputs,
            encoder_hidden_states=sources,
            encoder_attention_mask=source_mask,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        ).last_hidden_state
        return hidden[:, 0]


class EncoderPass(nn.Module):
    """The encoder stack over one source without padding (Section 3.1: the embedded source, scaled by sqrt(d_model)
    and with its positional encodings added, through N layers), then each decoder layer's encoder-decoder keys and
    values of its output (Section 3.2.3: "the memory keys and values come from the output of the encoder"), the
    function the compiled encoder is. Returns the encoder output (1, S, D), then each layer's keys (1, h, S, d_k) and
    values (1, h, S, d_v), contiguous, as the decoding session keeps them (`SourceKeysValues`).

    It takes the source tokens' rows of the embedding matrix (1, S, D), not their ids: that matrix is the decoder's
    and the pre-softmax projection's too (Section 3.4), and compiled into the encoder it would be held twice."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model  # (its tensors keep the model's names: `step_tensors`)

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self.model.get_encoder()(inputs_embeds=rows, return_dict=True).last_hidden_state
        memory = []
        for layer in self.model.get_decoder().layers:
            memory.extend(part.contiguous() for part in layer.cross_attn.keys_values(hidden))
        return (hidden, *memory)


def onednn_products(model: nn.Module):
    """The decoder's `nn.Linear` layers computed by oneDNN's inner product on their own weights while the step is
    exported, so that the compiled step calls oneDNN rather than oneMKL (`gemm_backend`). The step's usual single
    row is a matrix-vector product bound by reading W: oneDNN reads the weights as they are as fast as packed
    ones there, and spreads the product over every thread, where oneMKL's runs on one (the decoder's 48
    products at one row on an AMD EPYC: 9.6 against 10.2 ms on one thread, 5.9 against 9.7 on two)."""
    layers = [module for module in model.get_decoder().modules() if type(module) is nn.Linear]
    return forwards_installed([(module, _OwnWeights(module)) for module in layers])


class _OwnWeights(OneDNNForward):
    """`OneDNNForward` that reads the module's weight and bias at each call: export traces them as the module's
    parameters then (the step's user-managed constants), where tensors held by the forward would be lifted into
    the graph as constants of their own."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Linear):
        self.module = module

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.module.bias


class _Int8Call(nn.Module):
    """Stands in for int8 layer `index` while the step is exported: a call of `vaswani_tx::int8_linear`, which the
    compiled step makes to the model's own layer (`int8_operator`). The layer's packed weights are a TorchBind
    object, which `torch.export` cannot trace."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vaswani_tx.int8_linear(x, self.index)


@contextlib.contextmanager
def int8_calls(model: nn.Module):
    """While the block runs, each of the model's int8 layers is an `_Int8Call` of its index (`int8_layers`'s order),
    and the operator's table holds the layers."""
    layers = int8_layers(model)
    int8_operator().layers = [module for _, module in layers]
    parents = [model.get_submodule(name.rpartition(".")[0]) for name, _ in layers]
    for index, ((name, _), parent) in enumerate(zip(layers, parents)):
        setattr(parent, name.rpartition(".")[2], _Int8Call(index))
    try:
        yield
    finally:
        for (name, module), parent in zip(layers, parents):
            setattr(parent, name.rpartition(".")[2], module)


def _example(model: nn.Module, few_rows: bool = False) -> tuple:
    config = model.config
    layers, heads = config.num_decoder_layers, config.num_heads
    # the sizes Inductor tunes the products for: the few-rows step's at 4 rows (2 sources of 2 rows; a size of 1
    # would be taken as fixed)
    groups, rows, source, prefix = (2, 2, 5, 4) if few_rows else (3, 2, 5, 4)
    dtype = next(model.parameters()).dtype  # float32, or bfloat16 for a bfloat16 model's step

    def slots(depth):
        return tuple(torch.zeros(prefix, groups, rows, heads, depth, dtype=dtype) for _ in range(layers))

    def per_source(depth):
        return tuple(torch.zeros(groups, heads, source, depth, dtype=dtype) for _ in range(layers))

    tokens = torch.full((groups, rows), config.decoder_start_token_id, dtype=torch.long)
    if few_rows:
        tokens = torch.zeros(groups, rows, config.d_model, dtype=dtype)
    sources = torch.zeros(groups, source, config.d_model, dtype=dtype)
    mask = torch.ones(groups, source, dtype=torch.long)
    return tokens, slots(config.d_k), slots(config.d_v), per_source(config.d_k), per_source(config.d_v), sources, mask


# `vaswani-tx compile`'s parts, in the order one process compiles them, and what each took relative to the others on
# 2 cores with Inductor's and the libraries' caches cold (a tiny model, tests/test_compiled_decoding.py's; the main
# job's, within 20%): how `compiled_apart` shares them between processes. The int8 kernel and both int8 steps are
# one part, compiled in that order: the few-rows step calls the kernel, which the process loads once it is built.
PART_SECONDS = {
    "float32": 28,
    "float32-few": 30,
    "float32-encoder": 20,
    "beams": 17,
    "int8": 44,
    "bfloat16": 19,
    "bfloat16-few": 46,
}


# The parts for calls of a few rows (`few_rows`): the few-rows steps, and the encoder of one source a call.
FEW_ROWS_PARTS = ("float32-few", "float32-encoder", "bfloat16-few")


# Parts whose compiling times kernels to choose among them (Inductor's `max_autotune` with two GEMM backends: the
# bfloat16 few-rows step, `compile_decoder_step`): compiled with nothing else running, after the others. Beside
# another compile its timings chose differently (a tiny model's step: 55 packed constants where alone it had 73,
# products that went to aten's kernels rather than Inductor's).
TIMED_PARTS = ("bfloat16-few",)


def compile_decoder_steps(
    model: nn.Module,
    folder: str | os.PathLike,
    int8: bool = True,
    bf16: bool = True,
    few_rows: bool = True,
    jobs: int | None = None,
):
    """`vaswani-tx compile`: the float32 `model`'s step into `folder`, with `few_rows` its few-rows step too (calls
    of at most `FEW_ROWS_MAXIMA` rows: a sentence at a time, greedy or with a small beam), beam search's library
    for one source, then the int8 model's steps (`quantize_int8`'s copy) with `int8`, and with `bf16` the bfloat16
    model's where `--dtype auto` picks bfloat16 (the CPU has bf16 instructions), with `few_rows` its few-rows step
    too. Yields a line for each as it is written, or saying why there is none; `model` stays float32.

    `jobs`: how many processes compile the parts at once (`compiled_apart`); by default one per core this process
    may use, at most one per part. One part is mostly one core's work (Inductor's lowering in Python, then a g++
    call), so two cores compile them in about two thirds of the time; the bfloat16 few-rows step, whose compiling
    times kernels (`TIMED_PARTS`), comes last, alone. With 1, this process compiles them one after another. The
    steps are the same either way.

    Raises:
        UserInputError: a step that cannot be compiled here (no C++ compiler: `compile_decoder_step`)."""
    from .precision import bf16_is_fast

    # into the per-user cache, never the model's folder (from which nothing native is ever loaded: `native_folder`)
    folder = native_folder(folder)
    if folder is None:
        raise UserInputError("no weights to compile for: the model folder has no .safetensors or .bin file")
    folder.mkdir(parents=True, exist_ok=True)
    parts = [
        part
        for part in PART_SECONDS
        if (few_rows or part not in FEW_ROWS_PARTS) and (int8 or part != "int8") and (bf16 or "bfloat16" not in part)
    ]
    if bf16:
        fast, why = bf16_is_fast("cpu")
        if not fast:
            parts = [part for part in parts if "bfloat16" not in part]
            yield f"no bfloat16 step: --dtype auto decodes in float32 here ({why})"
    shared = [part for part in parts if part not in TIMED_PARTS]
    jobs = min(len(shared), usable_cores() if jobs is None else jobs)
    if jobs > 1:
        yield from compiled_apart(model, folder, shared, jobs)
        parts = [part for part in parts if part in TIMED_PARTS]  # the others are written
    for part in parts:
        yield from compiled_part(model, folder, part)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, as torch counts its threads)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compiled_part(model: nn.Module, folder: str | os.PathLike, part: str):
    """Compile one of `PART_SECONDS`' parts of float32 `model` into `folder`, yielding `compile_decoder_steps`'
    lines."""
    import copy
    import time

    from .quantization import quantize_int8

    start = time.perf_counter()

    def took() -> str:
        return f"in {time.perf_counter() - start:.1f} s"

    if part == "float32":
        yield f"wrote the compiled decoding step to {compile_decoder_step(model, folder)} {took()}"
    elif part == "float32-few":
        yield f"wrote the few-rows decoding step to {compile_decoder_step(model, folder, few_rows=True)} {took()}"
    elif part == "float32-encoder":
        yield f"wrote the compiled encoder of one source to {compile_encoder(model, folder)} {took()}"
    elif part == "beams":
        try:  # beam search's bookkeeping at a sentence a call, for every precision (one_source_beams.py)
            out = one_source_beams.build(folder)
        except UserInputError as error:
            yield f"{error}: beam search over one source keeps its Python loop"
        else:
            yield f"wrote the beam-search library to {out} {took()}"
    elif part == "int8":
        kernel = None
        try:  # the int8 products of a few rows (int8_rows.py), which the int8 model below takes when loaded
            kernel = int8_rows.build(folder)
        except UserInputError as error:
            yield f"{error}: the int8 model's products of a few rows stay fbgemm's"
        else:
            yield f"wrote the int8 few-rows kernel to {kernel} {took()}"
        start = time.perf_counter()
        try:
            quantized = quantize_int8(model)  # a copy, as the bfloat16 model below
        except UserInputError as error:  # no int8 engine in this torch: --int8 is refused here anyway
            yield f"no int8 step: {error}"
            return
        yield f"wrote the int8 model's compiled decoding step to {compile_decoder_step(quantized, folder)} {took()}"
        if kernel is not None and int8_rows.load(folder):
            if not has_rows_kernel(quantized):  # a model loaded from another folder than this one, or none
                use_rows_kernel(quantized)
            start = time.perf_counter()
            out = compile_decoder_step(quantized, folder, few_rows=True)
            yield f"wrote the int8 model's few-rows decoding step to {out} {took()}"
    else:
        # the copy goes without the float32 step, whose library would be loaded again for it
        bfloat16 = copy.deepcopy(model, memo={id(getattr(model, "_compiled_step", None)): None}).to(torch.bfloat16)
        if part == "bfloat16":
            yield f"wrote the bfloat16 model's compiled decoding step to {compile_decoder_step(bfloat16, folder)} {took()}"
        else:
            out = compile_decoder_step(bfloat16, folder, few_rows=True)
            yield f"wrote the bfloat16 model's few-rows decoding step to {out} {took()}"


def shared_out(parts: list[str], jobs: int) -> list[list[str]]:
    """`parts` in `jobs` groups of about equal time (`PART_SECONDS`: the longest first, each into the group that
    ends soonest), each group in `PART_SECONDS`' order; the first group holds "float32" where it is compiled."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    for part in sorted(parts, key=PART_SECONDS.__getitem__, reverse=True):
        min(groups, key=lambda group: sum(map(PART_SECONDS.__getitem__, group))).append(part)
    groups = [sorted(group, key=list(PART_SECONDS).index) for group in groups if group]
    return sorted(groups, key=lambda group: "float32" not in group)


def compiled_apart(model: nn.Module, folder: str | os.PathLike, parts: list[str], jobs: int):
    """`compile_decoder_steps` with its parts shared between this process and `jobs` - 1 others (`shared_out`).
    Each other is a fresh Python (`compiling_process`: nothing of this process' state or its `__main__` is
    carried over) that reads the model from a file written for it (config and weights: the model as it is, wherever
    it came from) and sends back each line as it writes its part. Their lines are passed on as they come; the
    first error is raised once this process' own parts are done (a `UserInputError` as itself). An interrupted
    compile stops them all."""
    import queue as queues
    import subprocess
    import tempfile
    import threading

    groups = shared_out(parts, jobs)
    yield f"compiling {len(parts)} parts in {len(groups)} processes at once (--jobs 1: one after another)"
    messages: queues.Queue = queues.Queue()
    with tempfile.TemporaryDirectory(prefix="vaswani-tx-compile-") as scratch:
        model_file = os.path.join(scratch, "model.pt")
        write_model(model, model_file)
        others = [
            subprocess.Popen(
                [*compiling_command(), model_file, str(folder), *group],
                stdout=subprocess.PIPE,
                env=compiling_environment(),
            )
            for group in groups[1:]
        ]

        def read(process: subprocess.Popen) -> None:
            for raw in process.stdout:
                try:
                    messages.put(dict(json.loads(raw)))
                except ValueError:  # not a message (nothing else writes there): passed on as it is
                    messages.put({"line": raw.decode(errors="replace").rstrip()})
            messages.put({"ended": process.wait()})

        for process in others:
            threading.Thread(target=read, args=(process,), daemon=True).start()
        failures, ended = [], 0

        def passed_on(until_all_ended: bool):
            """The others' lines: those received so far, or all until every other process has ended."""
            nonlocal ended
            while ended < len(others) if until_all_ended else not messages.empty():
                ended, line = _received(messages.get(), ended, failures)
                if line:
                    yield line

        try:
            for part in groups[0]:
                yield from compiled_part(model, folder, part)
                yield from passed_on(until_all_ended=False)
            yield from passed_on(until_all_ended=True)
        finally:
            for process in others:
                if process.poll() is None:
                    process.terminate()
                process.wait()
    if failures:
        user, text = failures[0]
        raise UserInputError(text) if user else RuntimeError(text)


def write_model(model: nn.Module, path: str | os.PathLike) -> None:
    """`model`'s config and weights into `path`, for `read_model` in another process."""
    torch.save({"config": model.config.to_dict(), "state": model.state_dict()}, path)


def read_model(path: str | os.PathLike) -> nn.Module:
    """The model `write_model` wrote, in evaluation mode."""
    from .configuration_vaswani import VaswaniConfig
    from .modeling_vaswani import VaswaniForConditionalGeneration

    saved = torch.load(path, mmap=True, weights_only=True)
    model = VaswaniForConditionalGeneration(VaswaniConfig.from_dict(saved["config"]))
    model.load_state_dict(saved["state"])
    return model.eval()


def compiling_command() -> list[str]:
    """The command line of a `compiling_process`, before its arguments."""
    import sys

    return [sys.executable, "-c", "from vaswani_tx.compile_step import compiling_process as run; run()"]


def compiling_environment() -> dict[str, str]:
    """This process' environment for a `compiling_process`, with this package first on its path (wherever this
    process found it: installed, or a checkout's src on `sys.path`)."""
    import vaswani_tx

    package_root = str(Path(vaswani_tx.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}


def _received(message: dict, ended: int, failures: list) -> tuple[int, str | None]:
    """One message of a `compiling_process`: (processes ended so far, the line to pass on or None)."""
    if "line" in message:
        return ended, message["line"]
    if "error" in message:
        failures.append((message["user"], message["error"]))
    elif message["ended"] != 0 and not failures:  # killed (out of memory, a signal) before it could say why
        failures.append((False, f"a compiling process ended with exit code {message['ended']} (its output is above)"))
    return ended + ("ended" in message), None


def compiling_process() -> None:
    """A process of `compiled_apart` (arguments: the model's file, the folder, the parts): the model rebuilt from its
    config and weights, then its parts, each line sent as a JSON line on stdout. Everything else written to stdout
    goes to stderr, where it cannot be taken for a message. Stopped (SIGTERM, Ctrl-C), it leaves no partial folder
    (`atomic_folder`) and exits 130."""
    import sys

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(**message) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    model_file, folder, *parts = sys.argv[1:]
    try:
        with sigterm_as_interrupt():  # stopped by `compiled_apart` (SIGTERM): its folder's partial parts removed
            model = read_model(model_file)
            for part in parts:
                for line in compiled_part(model, folder, part):
                    send(line=line)
    except KeyboardInterrupt:
        sys.exit(130)
    except UserInputError as error:
        send(error=str(error), user=True)
        sys.exit(2)
    except Exception as error:
        import traceback

        traceback.print_exc()
        send(error=f"{type(error).__name__}: {error}", user=False)
        sys.exit(1)


def compile_decoder_step(model: nn.Module, folder: str | os.PathLike, few_rows: bool = False) -> Path:
    """Export and compile `model`'s decoding step into `folder`/compiled, or `folder`/compiled-int8 for an int8 model
    (`quantize_int8`), `folder`/compiled-bf16 for a bfloat16 one, replaced whole; returns that folder.

    `few_rows` (a float32 or bfloat16 model): the step for calls of at most `FEW_ROWS_MAXIMA` rows, into
    `folder`/compiled-few (compiled-few-bf16 for a bfloat16 model, where its products read half the bytes). Its
    weights are compiled into it (Inductor's freezing), packed for Inductor's own matrix-vector kernels
    (`max_autotune` with its C++ GEMM template), which read them about twice as fast as oneDNN's product at 1-4 rows
    (the base model's 48 decoder products on an AMD EPYC, two threads: 2.5-3.3 against 5.4-6.8 ms) and fall behind
    from about 12 rows, where each further block of rows reads the weights again. The embedding matrix stays out of it (its
    input is the tokens' embedding rows): it is the projection's too, and would be held twice.

    Raises:
        UserInputError: a model this cannot compile (not float32 or bfloat16 on the CPU, apart from int8 layers)."""
    from torch.export import Dim, export

    parameter = next(model.parameters())
    kind = precision(model)
    if parameter.device.type != "cpu" or kind is None:
        raise UserInputError(
            f"the compiled decoding step is for float32, bfloat16 and int8 models on the CPU; this one is "
            f"{parameter.dtype} on {parameter.device} (load it without dtype/device arguments)"
        )
    int8 = kind == "int8"
    # The int8 model's few-rows step: its products are calls of the int8 few-rows kernel on the layers' own buffers
    # (`rows_calls`), the rest compiled as the other int8 step's; it reads the model's tensors as that one does.
    rows_kernel = int8 and few_rows
    if rows_kernel and not has_rows_kernel(model):
        raise UserInputError(
            "the int8 few-rows step needs the int8 few-rows kernel (int8_rows.py): build it into the folder and "
            "quantize the model again"
        )
    step_folder = Path(folder) / (FEW_ROWS_FOLDERS[kind] if few_rows else PRECISIONS[kind][0])
    model.eval()
    # Positions the step can encode: the model's maximum (sinusoids: `whole_table`).
    rows = int(model.config.max_position_embeddings)
    table = whole_table(model.get_decoder(), rows, parameter)
    layers = model.config.num_decoder_layers
    groups, beams = Dim("sources", min=1, max=65536), Dim("rows_per_source", min=1, max=1024)
    source, prefix = Dim("source_length", min=1, max=65536), Dim("prefix", min=1, max=rows)
    dims = {
        "tokens": {0: groups, 1: beams},
        "self_keys": ({0: prefix, 1: groups, 2: beams},) * layers,
        "self_values": ({0: prefix, 1: groups, 2: beams},) * layers,
        "cross_keys": ({0: groups, 2: source},) * layers,
        "cross_values": ({0: groups, 2: source},) * layers,
        "sources": {0: groups, 1: source},
        "source_mask": {0: groups, 1: source},
    }
    packed = few_rows and not rows_kernel  # its weights compiled into it, packed for Inductor's products
    step = DecoderStep(model, embedded=packed)
    # float32 products through oneDNN where chosen (the few-rows step's: Inductor's own); bfloat16 ones are oneDNN's
    float32 = kind == "float32" and not few_rows
    products = onednn_products(model) if float32 and gemm_backend() == "onednn" else contextlib.nullcontext()
    layers = rows_calls(model) if rows_kernel else int8_calls(model) if int8 else contextlib.nullcontext()
    with torch.no_grad(), products, layers:
        program = export(step, _example(model, packed), dynamic_shapes=dims, strict=False)
    known = step_tensors(model)
    only_weights_read(program, known, table, "the decoder step")
    with atomic_folder(step_folder) as out:
        # (a bfloat16 step's batched attention products have no C++ template: aten's kernels take those)
        configs = packed_configs("CPP" if kind == "float32" else "CPP,ATEN") if packed else {}
        configs["aot_inductor.package_constants_in_so"] = False
        package = _aoti_compiled(program, out, configs, "the decoding step")
        if packed:
            constants = _weights_apart(Path(package), known, out / FEW_ROWS_WEIGHTS)
        else:
            runner = torch._inductor.aoti_load_package(package)
            constants = {name: (name if name in known else TABLE) for name in runner.get_constant_fqns()}
        manifest = {
            **library_manifest(model, rows, table, constants, kind, out),
            **({"int8_layers": int8_signature(model)} if int8 else {}),
            **({"few_rows": FEW_ROWS_MAXIMA[kind]} if packed else {}),
            **({"rows_kernel": int8_rows.source_digest(), "rows": FEW_ROWS_MAXIMA[kind]} if rows_kernel else {}),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return step_folder


def compile_encoder(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Export and compile float32 `model`'s encoder for one source without padding (`EncoderPass`, any source length
    up to the model's positions) into `folder`/compiled-encoder, replaced whole; returns that folder.

    A sentence a call runs the encoder once over a handful of rows (3-40 source tokens), where each product reads
    its weights for a few rows and Python's per-operator overhead is a large share: compiled (Inductor's freezing),
    it takes about half the eager encoder's time (docs/speed.md). Its products are oneMKL's on the model's own
    weights where oneMKL is the CPU's GEMM library, else Inductor's C++ GEMM template on weights packed into a copy
    of its own, `compiled-encoder/weights.safetensors` (`encoder_configs`; the manifest's `weights_packed`). Calls
    of several sources, or padded ones, keep the eager encoder, whose products serve many rows well.

    Raises:
        UserInputError: a model this cannot compile (not float32 on the CPU; no C++ compiler)."""
    from torch.export import Dim, export

    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or precision(model) != "float32":
        raise UserInputError(
            f"the compiled encoder is for float32 models on the CPU; this one is {parameter.dtype} on "
            f"{parameter.device} (load it without dtype/device arguments)"
        )
    model.eval()
    rows = int(model.config.max_position_embeddings)
    table = whole_table(model.get_encoder(), rows, parameter)
    # a typical sentence's length: the size Inductor tunes the products for (1 would be taken as fixed)
    example = torch.zeros(1, 16, model.config.d_model)
    with torch.no_grad():
        program = export(
            EncoderPass(model), (example,), dynamic_shapes={"rows": {1: Dim("source_length", max=rows)}}, strict=False
        )
    known = step_tensors(model)
    only_weights_read(program, known, table, "the encoder")
    packed = gemm_backend() != "mkl"
    with atomic_folder(Path(folder) / ENCODER_FOLDER) as out:
        configs = {**encoder_configs(packed), "aot_inductor.package_constants_in_so": False}
        package = Path(_aoti_compiled(program, out, configs, "the encoder"))
        constants = _weights_apart(package, known, out / FEW_ROWS_WEIGHTS)
        manifest = {**library_manifest(model, rows, table, constants, "float32", out), "part": "encoder"}
        manifest["weights_packed"] = packed
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return Path(folder) / ENCODER_FOLDER


def encoder_configs(packed: bool) -> dict:
    """Inductor's settings for the encoder. Where oneMKL is this CPU's GEMM library (`gemm_backend`), its products are
    ATen's, oneMKL's on the model's own weights (no packed copy): on an Intel Xeon with AMX (one thread, the recipe's
    model) 1.23 against 1.51 ms at 15 source tokens, 1.74 against 2.76 at 30, 4.66 against 10.64 at 120, since
    oneMKL's GEMM keeps its speed as the rows grow and the template's does not. Elsewhere (oneDNN's CPUs), the
    weights are packed for Inductor's C++ GEMM template, as for the few-rows step (`packed_configs`)."""
    if packed:
        return packed_configs("CPP")
    return {**packed_configs("ATEN"), "cpp.weight_prepack": False}  # (prepacked, they would be oneDNN's products)


def whole_table(stack: nn.Module, rows: int, like: torch.Tensor) -> torch.Tensor | None:
    """The stack's (encoder's or decoder's) sinusoid table made afresh at `rows` positions, the model's maximum, which
    the exported graph keeps as a constant (loading makes it again, from the same function); None for learned
    positions, which are weights."""
    positions = stack.embeddings.embed_positions
    if not hasattr(positions, "table_function"):
        return None
    positions._table = None
    positions(rows, 0, like=like)
    return positions._table


def only_weights_read(program, known: dict, table: torch.Tensor | None, what: str) -> None:
    """Refuse an exported `program` that reads tensors other than the model's weights (`known`) and its table."""
    others = [name for name in program.constants if name not in known]
    if len(others) > 1 or (others and table is None):
        raise UserInputError(f"{what} reads tensors that are not the model's weights: {others}")


def packed_configs(backends: str) -> dict:
    """Inductor's settings for a library with its weights in it, packed for its C++ GEMM template (the few-rows steps,
    the encoder): freezing, the products chosen among `backends`, the packed weights written one pickle each, which
    `_weights_apart` moves out of the package."""
    return {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": backends,
        "aot_inductor.package_constants_on_disk_format": "pickle_weights",
    }


def library_manifest(
    model: nn.Module, rows: int, table: torch.Tensor | None, constants: dict, kind: str, out: Path
) -> dict:
    """What a compiled library's manifest says in every case: what it was made for (torch, CPU, GEMM library,
    architecture, weights, precision), the positions it encodes, where each of its tensors comes from, and the
    sha256 of each file in `out` (checked before loading: `compiled_decoding._changed_files`)."""
    return {
        "files": {path.name: file_sha256(path) for path in sorted(out.iterdir()) if path.is_file()},
        "format": FORMAT,
        **machine(),
        "architecture": architecture_fingerprint(model.config),
        "weights": weights_fingerprint(model),
        "positions": rows,
        "table_rows": None if table is None else table.shape[0],
        "constants": constants,
        "precision": kind,
    }


def _aoti_compiled(program, out: Path, configs: dict, what: str) -> str:
    """AOTInductor's package of the exported `program` in `out`; a compiler that fails is the environment's."""
    try:
        return torch._inductor.aoti_compile_and_package(
            program, package_path=str(out / PACKAGE), inductor_configs=configs
        )
    except Exception as error:  # no C++ compiler, a platform Inductor does not support
        lines = str(error).strip().splitlines() or [type(error).__name__]
        raise UserInputError(
            f"AOTInductor could not compile {what} ({lines[0][:300]}); it needs a C++ compiler (g++ or clang++). "
            "The model decodes eagerly without it."
        ) from error


def _weights_apart(package: Path, known: dict, weights: Path) -> dict[str, str]:
    """A packed library's own tensors (the few-rows steps', the encoder's: the weights as Inductor packed them, the
    positional table) moved from the package (`pickle_weights`: one pickle each) into `weights`, a safetensors file
    that loading maps into memory rather than copies, and the package rewritten without them. The model's own
    weights, which the package also holds, are dropped: the library reads the model's tensors there (they serve no
    product of it). Returns the manifest's constants: each name the library knows, and where its tensor comes from."""
    import io
    import zipfile

    from safetensors.torch import save_file

    with zipfile.ZipFile(package) as archive:
        members = archive.infolist()
        config_name = next(member.filename for member in members if member.filename.endswith("weights_config.json"))
        config = json.loads(archive.read(config_name))
        root = config_name.split("/data/")[0]
        tensors, constants = {}, {}
        for name, (file, shape, stride, offset) in config.items():
            if name in known:
                constants[name] = name
                continue
            whole = torch.load(io.BytesIO(archive.read(f"{root}/data/weights/{file}")), weights_only=True)
            tensor = whole.as_strided(shape, stride, offset)
            if not tensor.is_contiguous():
                raise UserInputError(f"the compiled library's tensor {name} is not contiguous ({stride}); not written")
            tensors[name] = tensor.clone()
            constants[name] = FEW_ROWS_WEIGHTS
        save_file(tensors, str(weights))
        weights.chmod(0o644)  # as the package beside it (save_file makes it private)
        kept = [member for member in members if "/data/weights/" not in member.filename]
        rewritten = package.with_suffix(".rewriting")
        with zipfile.ZipFile(rewritten, "w") as out:
            for member in kept:
                out.writestr(member, archive.read(member.filename))
    os.replace(rewritten, package)
    return constants
