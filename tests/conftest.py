"""Shared test fixtures.

Real data lives in ``../shared/data`` beside the checkout (not part of the package); set
``VASWANI_SHARED_DATA`` to point elsewhere. Tests that need it skip with a clear reason when absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("VASWANI_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set VASWANI_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_translator(tmp_path_factory, shared_data):
    """A saved random-weight model (d_model 24, 3 heads, 2+2 layers) with a 500-token BPE learned on
    Multi30k val (both sides): (folder, model, tokenizer). Shared read-only by the pipeline, attention
    map and publishing tests; tests that change a model build their own."""
    import torch

    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani_tx.data.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("tiny-translator")
    corpus = tmp_path_factory.mktemp("tiny-corpus") / "val.txt"
    corpus.write_text(
        "".join((shared_data / "multi30k-en-de" / f"val.{lang}").read_text(encoding="utf-8") for lang in ("de", "en")),
        encoding="utf-8",
    )
    tokenizer = train_tokenizer([corpus], vocab_size=500, show_progress=False)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer),
            d_model=24,
            num_heads=3,
            d_ff=40,
            num_encoder_layers=2,
            num_decoder_layers=2,
        )
    ).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer
