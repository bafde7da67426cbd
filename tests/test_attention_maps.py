"""Attention maps (issue: translate, score and publish): weights per kind, PNGs per layer, bad input."""

from __future__ import annotations

import pytest
import torch

from vaswani_tx.cli import main
from vaswani_tx.demo.attention_maps import attention_weights, plot_attention_maps


@pytest.fixture(scope="module")
def saved(tiny_translator):
    return tiny_translator


def test_weights_have_the_right_axes_and_sum_to_one(saved):
    _, model, tokenizer = saved
    maps = attention_weights(model, tokenizer, "Ein Hund läuft.", "A dog runs.")
    source = tokenizer("Ein Hund läuft.")["input_ids"]
    target = tokenizer(text_target="A dog runs.")["input_ids"]
    assert len(maps["encoder"]["layers"]) == 2 and maps["encoder"]["layers"][0].shape == (3, len(source), len(source))
    assert maps["cross"]["layers"][1].shape == (3, len(target), len(source))
    assert maps["decoder"]["queries"][0] == "<s>" and maps["encoder"]["keys"][-1] == "</s>"
    for kind in maps.values():
        torch.testing.assert_close(kind["layers"][0].sum(-1), torch.ones(kind["layers"][0].shape[:2]))
    assert torch.triu(maps["decoder"]["layers"][0][0], diagonal=1).abs().max() == 0


def test_command_writes_one_png_per_kind_and_layer(saved, tmp_path):
    folder, _, _ = saved
    assert (
        main(
            [
                "attention",
                str(folder),
                "--source",
                "Zwei Männer.",
                "--target",
                "Two men.",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted(f"{k}-layer{n}.png" for k in ("encoder", "decoder", "cross") for n in (1, 2))
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.glob("*.png"))


def test_without_target_the_models_translation_is_drawn(saved, tmp_path):
    _, model, tokenizer = saved
    paths = plot_attention_maps(model, tokenizer, "Ein Hund.", tmp_path, kinds=("cross",), layers=[0])
    assert [p.name for p in paths] == ["cross-layer1.png"]


def test_bad_layer_or_kind_is_refused(saved, tmp_path):
    _, model, tokenizer = saved
    with pytest.raises(ValueError, match=r"layer 5 does not exist: the encoder stack has 2 layers"):
        plot_attention_maps(model, tokenizer, "Ein Hund.", tmp_path, target="A dog.", kinds=("encoder",), layers=[5])
    with pytest.raises(ValueError, match=r"unknown attention kind\(s\) \['self'\]"):
        plot_attention_maps(model, tokenizer, "Ein Hund.", tmp_path, target="A dog.", kinds=("self",))
