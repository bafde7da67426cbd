"""The demo page: `vaswani-tx demo MODEL` serves a Gradio page for a saved model folder, and `--write-space`
writes a Hugging Face Space that serves the same page for the model pushed to the hub.

The page has a text box, the beam size and length penalty (defaulting to the model's generation config), the
translation and the attention of that translation: encoder self-attention, decoder self-attention or
encoder-decoder attention, chosen by layer and head, as a heatmap with the tokens on its axes, above all the
heads of that layer. The translation is `vaswani-tx translate`'s for the same settings (`Translator` decodes it);
the attention is one teacher-forced pass over the source and exactly the tokens `generate()` produced.

Endpoints, for `gradio_client.Client(url).predict(...)`: ``/translate`` (text, optional beam size and alpha ->
the translation), the Translate button's own function; ``/attention`` (the same arguments -> JSON: the
translation, the tokens, the notes, and the weights of every kind as layers x heads x queries x keys).

Input the page refuses is a message on the page (a `gradio_client` AppError over the API), never a traceback,
and the server keeps serving: empty text, only spaces, a text of more tokens than the model has positions
(`max_position_embeddings`, `</s>` included; refused rather than cut, so that a translation is never of part of
the text), a beam size that is not a whole number from 1 to 16 (or the model's own, if larger), a length penalty
that is not a finite number. Characters outside the vocabulary
(read as `<unk>`, or as bytes by a BPE with byte fallback) are translated with a warning naming them.
Requests wait in Gradio's queue and reach the model one at a time.

This file travels into the Space (`vaswani_demo/`, with `attention_maps.py`, the engine's `settings.py` and
`errors.py`): it imports torch, transformers, matplotlib and Gradio, and those three relatively;
`vaswani_tx.engine.translation` only in `build_demo`.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vaswani_tx.engine.settings import as_generate_reads
from vaswani_tx.model.errors import UserInputError, check_source_length

from .attention_maps import KINDS, attention_from_ids, decoder_inputs_from_output, draw_map, heads_figure

INSTALL_HINT = "pip install -e '.[demo]' (in a checkout of vaswani_tx) or pip install gradio"
SPACE_PACKAGE = "vaswani_demo"
SPACE_FILES = ("demo.py", "attention_maps.py", "settings.py", "errors.py")
MAX_BEAMS = 16
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")  # translation.one_line's

# (text, num_beams, length_penalty) -> (translation, source ids (1, S), the generate() output row (T,))
TranslateFn = Callable[[str, int, float], tuple]


def import_gradio():
    """Gradio, with its analytics off (no version check, no telemetry); UserInputError saying how to install it."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    try:
        import gradio
    except ImportError:
        raise UserInputError(f"the demo needs Gradio, an optional extra: {INSTALL_HINT}") from None
    return gradio


class _KeepIds:
    """The model as `Translator` sees it, keeping the ids of its `generate()` call, so that the attention is drawn
    for exactly the tokens the translation came from. One per request: nothing is shared between requests."""

    def __init__(self, model):
        self._model = model
        self.input_ids = self.output_ids = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, **kwargs):
        self.input_ids = kwargs["input_ids"]
        self.output_ids = self._model.generate(**kwargs)
        return self.output_ids


def translator_function(translator) -> TranslateFn:
    """A `vaswani_tx.engine.translation.Translator` as the page's translate function (`vaswani-tx translate`'s output)."""

    def translate(text: str, num_beams: int, length_penalty: float) -> tuple:
        model = _KeepIds(translator.model)
        [translation] = replace(translator, model=model).translate(
            [text], num_beams=num_beams, length_penalty=length_penalty
        )
        return translation, model.input_ids[:1].cpu(), model.output_ids[0].cpu()

    return translate


def generate_function(model, tokenizer) -> TranslateFn:
    """The page's translate function without vaswani_tx (the Space): what `Translator.translate` does for one
    line, `generate()` with the model's generation config, decoded without special tokens onto one line."""
    import torch

    def translate(text: str, num_beams: int, length_penalty: float) -> tuple:
        encoded = tokenizer([text], return_tensors="pt").to(model.device)
        with torch.inference_mode():
            output = model.generate(**encoded, num_beams=num_beams, length_penalty=length_penalty)
        text = _LINE_BREAKS.sub(" ", tokenizer.decode(output[0], skip_special_tokens=True)).strip()
        return text, encoded["input_ids"].cpu(), output[0].cpu()

    return translate


@dataclass
class Analysis:
    """One translation with its attention (`attention_maps.attention_from_ids`) and the notes shown with it."""

    translation: str
    maps: dict
    notes: list[str] = field(default_factory=list)
    settings: str = ""


def unknown_characters(text: str, tokenizer) -> tuple[list[str], list[str]]:
    """The characters of `text` the vocabulary holds no symbol for: (read as `<unk>`, read as bytes)."""
    chars = list(dict.fromkeys(c for c in text if not c.isspace()))
    unknown, as_bytes = [], []
    for char, ids in zip(chars, tokenizer(chars, add_special_tokens=False)["input_ids"] if chars else []):
        tokens = tokenizer.convert_ids_to_tokens(ids)
        if tokenizer.unk_token_id in ids:
            unknown.append(char)
        elif any(_BYTE_TOKEN.fullmatch(token) for token in tokens):
            as_bytes.append(char)
    return unknown, as_bytes


class DemoPage:
    """The page for one model: its checks, its translate and attention functions, and `blocks()`, the page."""

    def __init__(self, model, tokenizer, translate: TranslateFn, title: str):
        self.model, self.tokenizer, self._translate, self.title = model, tokenizer, translate, title
        # the fields a checkpoint leaves None (OPUS-MT sets no length_penalty) as generate() reads them
        self.config, self.generation = model.config, as_generate_reads(model.generation_config)
        self.max_beams = max(MAX_BEAMS, self.generation.num_beams)

    def settings(self, num_beams, length_penalty) -> tuple[int, float]:
        """Beam size and alpha from the page (None: the model's), checked."""
        num_beams = self.generation.num_beams if num_beams is None else num_beams
        length_penalty = self.generation.length_penalty if length_penalty is None else length_penalty
        if not float(num_beams).is_integer() or not 1 <= num_beams <= self.max_beams:
            raise UserInputError(f"the beam size must be a whole number from 1 to {self.max_beams}, got {num_beams}")
        if not math.isfinite(length_penalty):
            raise UserInputError(f"the length penalty (alpha) must be a finite number, got {length_penalty}")
        return int(num_beams), float(length_penalty)

    def check(self, text: str) -> list[str]:
        """Refuse a text the page does not translate (UserInputError); the notes for one it translates."""
        if not text:
            raise UserInputError("the text is empty: type a sentence to translate")
        if not text.strip():
            raise UserInputError("the text is only spaces: type a sentence to translate")
        check_source_length(len(self.tokenizer(text)["input_ids"]), self.config)
        unknown, as_bytes = unknown_characters(text, self.tokenizer)
        notes = []
        if unknown:
            notes.append(f"not in the vocabulary, read as {self.tokenizer.unk_token}: {' '.join(unknown)}")
        if as_bytes:
            notes.append(f"not in the vocabulary, read as bytes: {' '.join(as_bytes)}")
        return notes

    def analyse(self, text: str, num_beams=None, length_penalty=None) -> Analysis:
        """Check, translate, and run the model once more, teacher-forced on the tokens of the translation."""
        num_beams, length_penalty = self.settings(num_beams, length_penalty)
        notes = self.check(text)
        start = time.perf_counter()
        translation, input_ids, output_ids = self._translate(text, num_beams, length_penalty)
        seconds = time.perf_counter() - start
        decoder_input_ids = decoder_inputs_from_output(output_ids, self.config.eos_token_id)[None]
        maps = attention_from_ids(self.model, self.tokenizer, input_ids, decoder_input_ids)
        settings = f"beam {num_beams}, length penalty {length_penalty:g}: {seconds:.2f} s"
        return Analysis(translation, maps, notes, settings)

    def _analysed(self, text: str, num_beams, length_penalty) -> Analysis:
        """`analyse` for the page and its API: refused input becomes gr.Error, a message on the page (an AppError
        for gradio_client), never a traceback; its notes become warnings on the page."""
        gr = import_gradio()
        try:
            analysis = self.analyse(text, num_beams, length_penalty)
        except UserInputError as err:
            raise gr.Error(str(err), print_exception=False) from None
        for note in analysis.notes:
            gr.Warning(note)
        return analysis

    def translate(self, text: str, num_beams: int | None = None, length_penalty: float | None = None):
        """Translate the text (the Translate button; the API's /translate returns the translation only)."""
        analysis = self._analysed(text, num_beams, length_penalty)
        return analysis.translation, analysis

    def attention(self, text: str, num_beams: int | None = None, length_penalty: float | None = None) -> dict:
        """Translate the text; its tokens and attention weights (each kind: layers x heads x queries x keys)."""
        analysis = self._analysed(text, num_beams, length_penalty)
        maps = analysis.maps
        weights = {kind: [layer.round(decimals=5).tolist() for layer in maps[kind]["layers"]] for kind in KINDS}
        return {
            "translation": analysis.translation,
            "notes": analysis.notes,
            "source_tokens": maps["encoder"]["keys"],
            "target_tokens": maps["decoder"]["keys"],
            **weights,
        }

    def draw(self, analysis: Analysis | None, kind: str, layer: int | None, head: int | None):
        """The heatmap of one head, the overview of its layer and the status line (the layer choices fit the kind)."""
        gr = import_gradio()
        if analysis is None:
            return gr.Radio(), None, None, ""
        maps = analysis.maps[kind]
        layers = len(maps["layers"])
        layer, head = min(max(int(layer or layers), 1), layers), min(max(int(head or 1), 1), self.config.num_heads)
        heads, queries, keys = maps["layers"][layer - 1], maps["queries"], maps["keys"]
        where = f"{maps['title']}, layer {layer}"
        status = (
            f"Source {len(analysis.maps['encoder']['keys'])} tokens, translation "
            f"{len(analysis.maps['decoder']['keys'])} tokens ({analysis.settings})."
        )
        status += "".join(f"\n\n**Warning:** {note}." for note in analysis.notes)
        return (
            gr.Radio(numbered(layers), value=layer),
            head_figure(heads[head - 1], queries, keys, f"{where}, head {head}"),
            heads_figure(heads, queries, keys, f"{where}: all heads", *_overview_sizes(len(queries), len(keys))),
            status,
        )

    def summary(self) -> str:
        config, generation = self.config, self.generation
        parameters = sum(p.numel() for p in self.model.parameters()) / 1e6
        return (
            'The Transformer of "Attention Is All You Need" (vaswani_tx): '
            f"{config.num_encoder_layers} + {config.num_decoder_layers} layers, d_model {config.d_model}, "
            f"{config.num_heads} head{'s' * (config.num_heads != 1)}, a vocabulary of {config.vocab_size}, {parameters:.2f}M parameters. Decoding defaults "
            f"(the model's generation config): beam {generation.num_beams}, length penalty {generation.length_penalty}."
        )

    def blocks(self):
        """The page, as `gr.Blocks` with its queue: `.launch()` serves it."""
        gr = import_gradio()
        config, generation = self.config, self.generation
        with gr.Blocks(title=f"{self.title} (vaswani_tx)", analytics_enabled=False) as page:
            gr.Markdown(f"## {self.title}\n{self.summary()}")
            with gr.Row():
                with gr.Column():
                    source = gr.Textbox(
                        label="Source", lines=3, placeholder="A sentence to translate", elem_id="source"
                    )
                    with gr.Row():
                        beams = gr.Slider(1, self.max_beams, generation.num_beams, step=1, label="Beam size")
                        alpha = gr.Number(generation.length_penalty, label="Length penalty (alpha)")
                    button = gr.Button("Translate", variant="primary", elem_id="translate")
                with gr.Column():
                    translation = gr.Textbox(label="Translation", lines=3, interactive=False, elem_id="translation")
                    status = gr.Markdown(elem_id="status")
            analysis = gr.State(time_to_live=3600)  # the last translation's attention, per visitor, for an hour
            with gr.Accordion("Attention of this translation", open=False, elem_id="attention"):
                with gr.Row():
                    kind = gr.Radio([(title, name) for name, (_, title) in KINDS.items()], value="cross", label="Kind")
                    # one button a layer and a head: a model of one layer or one head shows its one choice
                    layers = config.num_decoder_layers
                    layer = gr.Radio(numbered(layers), value=layers, label="Layer", elem_id="layer")
                    head = gr.Radio(numbered(config.num_heads), value=1, label="Head", elem_id="head")
                heatmap = gr.Plot(label="One head", elem_id="heatmap")
                overview = gr.Plot(label="All heads of the layer", elem_id="overview")
            drawn = dict(
                fn=self.draw, inputs=[analysis, kind, layer, head], outputs=[layer, heatmap, overview, status]
            )
            button.click(
                self.translate,
                [source, beams, alpha],
                [translation, analysis],
                api_name="translate",
                concurrency_id="model",
            ).success(**drawn, api_visibility="private", concurrency_id="draw")
            for control in (kind, layer, head):
                control.input(**drawn, api_visibility="private", concurrency_id="draw", trigger_mode="always_last")
            gr.api(self.attention, api_name="attention", concurrency_id="model")
        return page.queue(max_size=64, default_concurrency_limit=1)


def numbered(count: int) -> list[tuple[str, int]]:
    """The choices 1 to `count` of a layer or head control, as (label, value)."""
    return [(str(number), number) for number in range(1, count + 1)]


def head_figure(weights, queries: list[str], keys: list[str], title: str):
    """One head's (queries, keys) map with a colour bar, sized to its tokens but never past 12 inches."""
    from matplotlib.figure import Figure

    width, height = min(12, max(4.5, 0.22 * len(keys) + 2)), min(12, max(3.5, 0.22 * len(queries) + 1.5))
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    image = draw_map(ax, weights, queries, keys, title, _fontsize(max(len(queries), len(keys))))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    return fig


def _fontsize(tokens: int) -> float:
    return max(4.0, min(9.0, 220 / max(tokens, 1)))


def _overview_sizes(queries: int, keys: int) -> tuple[float, float]:
    """A panel's side in inches and the labels' size, for four panels a row across the page."""
    return min(5.0, max(3.0, 0.15 * max(queries, keys))), _fontsize(max(queries, keys)) * 0.8


def build_demo(model_dir: str | os.PathLike, device="cpu", dtype=None, int8: bool = False):
    """The page for a saved model folder (trained, averaged, converted; `int8` quantizes it for the CPU), as
    `gr.Blocks`, loaded as `vaswani-tx translate` loads it (`load_translator`: the same folder, tokenizer and
    device checks). Raises UserInputError when Gradio is not installed, before the model loads."""
    import_gradio()
    from vaswani_tx.engine.translation import load_translator

    translator = load_translator(model_dir, device=device, dtype=dtype, int8=int8)
    folder = Path(model_dir).resolve()
    title = f"{folder.parent.name}/{folder.name}"  # runs/multi30k-en-de/averaged: multi30k-en-de/averaged
    return DemoPage(translator.model, translator.tokenizer, translator_function(translator), title).blocks()


def build_hub_demo(repo_id: str):
    """The Space's page: the model and its tokenizer from a hub repo (or a folder) with the code saved next to
    the weights (`trust_remote_code`), without vaswani_tx."""
    import_gradio()
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)
    return DemoPage(model, tokenizer, generate_function(model, tokenizer), repo_id).blocks()


def serve(page, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Serve the page on host:port (no share link: nothing leaves this machine); returns when interrupted, or at
    once with `block=False` (then `page.close()` stops it)."""
    page.launch(
        server_name=host, server_port=port, share=False, ssr_mode=False, inbrowser=False, prevent_thread_lock=not block
    )
    return page


SPACE_APP = '''"""The demo page of the translation model {repo_id}, as a Hugging Face Space.

Written by `vaswani-tx demo MODEL --write-space DIR --repo-id {repo_id}`. The page's code is vaswani_tx's, in
{package}/; the model loads with the code saved next to its weights (trust_remote_code), so the Space needs
neither vaswani_tx nor more than requirements.txt (and Gradio, which the Space installs from README.md).
"""

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from {package}.demo import build_hub_demo  # noqa: E402

MODEL = {repo_id!r}

demo = build_hub_demo(MODEL)

if __name__ == "__main__":
    demo.launch()
'''

SPACE_README = """---
title: {title}
emoji: 🔤
colorFrom: blue
colorTo: indigo
sdk: gradio
sdk_version: {gradio_version}
app_file: app.py
pinned: false
models:
- {repo_id}
short_description: Translate, and see the attention by layer and head
---

# {title}

Translate with [{repo_id}](https://huggingface.co/{repo_id}), the Transformer of "Attention Is All You Need"
(vaswani_tx), and look at the attention of each translation: encoder self-attention, decoder
self-attention and encoder-decoder attention, by layer and head. The translation is the model's with its saved
decoding settings (those of `vaswani-tx translate`); beam size and length penalty can be changed on the page.

API: `gradio_client.Client("USER/SPACE").predict("A sentence.", api_name="/translate")` gives the translation;
`api_name="/attention"` gives the tokens and the attention weights too.

Publish: `huggingface-cli upload --repo-type space USER/SPACE .` in this folder; the model card links the Space
when the model is pushed with `push_to_hub(..., space="USER/SPACE")`.
"""


def write_space(folder: str | os.PathLike, repo_id: str, model_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write a Space serving the page for the hub model `repo_id` (a folder path also works, for testing):
    app.py, requirements.txt, README.md (the Spaces front matter, `models: [repo_id]`) and the page's code
    (this file, attention_maps.py, the engine's settings.py and errors.py in vaswani_demo/). `model_dir`, the local copy of the model,
    adds sentencepiece to the requirements when its tokenizer needs it. Returns the files written.
    `vaswani-tx demo --write-space` writes them into a temporary folder that then takes the place of DIR whole."""
    from importlib.metadata import version

    gradio = import_gradio()
    folder = Path(folder)
    package = folder / SPACE_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    requirements = ["torch>=2.4", "transformers>=5,<6", "safetensors>=0.4", "matplotlib>=3.7"]
    # Marian's and other SentencePiece tokenizers need it; the package's own (tokenizer.json) does not
    if model_dir is not None and any(any(Path(model_dir).glob(pattern)) for pattern in ("*.spm", "*.model")):
        requirements.append(f"sentencepiece>={version('sentencepiece')}")
    if model_dir is not None and (Path(model_dir) / "tokenization_fairseq.py").is_file():
        requirements.append(f"sacremoses>={version('sacremoses')}")  # FSMT's tokenizer, for converted fairseq models
    files = {
        folder / "app.py": SPACE_APP.format(repo_id=repo_id, package=SPACE_PACKAGE),
        folder / "requirements.txt": "".join(f"{line}\n" for line in requirements),
        folder / "README.md": SPACE_README.format(
            title=repo_id.rsplit("/", 1)[-1][:30], repo_id=repo_id, gradio_version=gradio.__version__
        ),
        package / "__init__.py": '"""The page of `vaswani-tx demo`, copied from vaswani_tx by `--write-space`."""\n',
    }
    here = Path(__file__).parent
    sources = {"demo.py": here, "attention_maps.py": here, "settings.py": here.parent / "engine"}
    sources["errors.py"] = here.parent / "model"
    for name in SPACE_FILES:  # one flat package there: the page's imports of each other become relative
        text = (sources[name] / name).read_text(encoding="utf-8")
        for module in ("model.errors", "engine.settings"):
            text = text.replace(f"from vaswani_tx.{module} import", f"from .{module.partition('.')[2]} import")
        files[package / name] = text
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
