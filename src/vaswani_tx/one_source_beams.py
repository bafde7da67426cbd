"""Beam search's bookkeeping in C++: `kernels/one_source_beams.cpp`, built once into a model folder.

At a sentence a call the decoder's step is a fraction of a millisecond, and `one_source_search`'s Python around it
(the 2k best continuations, the kept hypotheses, the length penalty, the early-stop test, the next tokens) took as
long again; in batches `beam_search`'s tensor bookkeeping was 8-11% of a pass. The library (`Beams`) does all of
that in one call a step, for one source or a batch's, with the same choices (fast_decoding.py's `one_source_search`
and `beam_search` say how they are made; `native_search` there drives it).

    vaswani-tx compile MODEL         # builds MODEL/beam-search/ beside the compiled steps (about 17 s, g++)
    from_pretrained(MODEL)           # loads it where its manifest fits; a sentence a call then decodes through it

It is loaded where its manifest matches this torch, this Python and this source; anywhere else beam search keeps
its Python loop (one logged line), with the same results.

The library also holds the other per-step work of a sentence a call that was many small tensor operations in Python:
the compiled step's slot views and their reordering (`PositionSlots`), and greedy search's int8 screen after the int8
product (`ScreenedArgmax`: the bound, the columns left, their float32 product, the argmax).
And it holds the few-rows decoder step (`decoder_rows`, and `decoder_rows_int8` for `--int8`, which
compiled_decoding.py's `RowsDecoder` calls): a sentence a call's whole step in one call, its products reading the
model's own weights once for all the rows (int8's through the int8 few-rows kernel, int8_rows.py); and the encoder of
one source (`encoder_rows`, `encoder_rows_int8`: `RowsEncoder`, which an int8 model's sentence a call takes), the same
function as the compiled encoder, on the same products. A decoding call's steps go through a `RowsSession`
(`RowsDecoder.session`), which holds the model's tensors and the call's encoder-decoder keys and values, and follows
beam search's reordering through each row's lineage rather than copying the keys and values (`PositionSlots.follow`).
"""

from __future__ import annotations

import os
from pathlib import Path

from . import compiled_decoding, native

# The library's names and its loading live with the compiled steps' (compiled_decoding.py travels with saved models).
FOLDER, LIBRARY, MODULE = (
    compiled_decoding.BEAMS_FOLDER,
    compiled_decoding.BEAMS_LIBRARY,
    compiled_decoding.BEAMS_MODULE,
)
SOURCE, MANIFEST = compiled_decoding.BEAMS_SOURCE, compiled_decoding.MANIFEST
manifest, load = compiled_decoding.beams_manifest, compiled_decoding.load_beams_library


def build(folder: str | os.PathLike) -> Path:
    """Compile the library into `folder`/beam-search (replaced whole); returns that folder. `load` (compiled_decoding's
    `load_beams_library`, which `from_pretrained` calls) loads it where its manifest fits.

    Raises:
        UserInputError: no C++ compiler could build it."""
    # OpenMP: the batched copy of the keys and values shared between torch's threads
    return native.build_into(
        Path(folder) / FOLDER, SOURCE, LIBRARY, "beam-search library", manifest(), python_module=MODULE
    )
