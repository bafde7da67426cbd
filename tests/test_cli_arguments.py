"""Options anywhere (issue 83): every command takes its options before, between and after its positional
arguments, as `parse_intermixed_args` reads them, `parse`'s actions included; what argparse refuses stays refused
in its own words."""

from __future__ import annotations

import pytest

from vaswani_tx.cli import build_parser, main, parse_arguments


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.mark.parametrize(
    "words",
    [
        ["translate", "--int8", "MODEL", "A dog.", "Two cats."],
        ["translate", "MODEL", "--int8", "A dog.", "Two cats."],
        ["translate", "MODEL", "A dog.", "--int8", "Two cats."],
        ["translate", "MODEL", "A dog.", "Two cats.", "--int8"],
        ["--debug", "translate", "MODEL", "--quiet", "A dog.", "--int8", "--num-beams", "2", "Two cats."],
    ],
)
def test_translate_takes_options_anywhere(parser, words):
    args = parse_arguments(parser, words)
    assert (args.command, args.model, args.sentences, args.int8) == (
        "translate",
        "MODEL",
        ["A dog.", "Two cats."],
        True,
    )


def test_evaluate_attention_and_parse_predict_take_options_anywhere(parser):
    args = parse_arguments(parser, ["evaluate", "-s", "a.en", "MODEL", "-r", "a.de", "-r", "b.de", "--num-beams", "1"])
    assert (args.model, args.source, args.reference, args.num_beams) == ("MODEL", "a.en", ["a.de", "b.de"], 1)
    args = parse_arguments(parser, ["attention", "--sentence", "A dog.", "MODEL", "-o", "maps", "--layers", "1", "2"])
    assert (args.model, args.source, args.output_dir, args.layers) == ("MODEL", "A dog.", "maps", [1, 2])
    args = parse_arguments(parser, ["parse", "predict", "--sentences", "in.txt", "MODEL", "-o", "trees.txt"])
    assert (args.action, args.model, args.sentences, args.output) == ("predict", "MODEL", "in.txt", "trees.txt")
    args = parse_arguments(parser, ["parse", "predict", "--num-beams", "3", "MODEL", "--trees", "a.mrg", "b.mrg"])
    assert (args.model, args.trees, args.num_beams, args.overrides) == ("MODEL", ["a.mrg", "b.mrg"], 3, [])


def test_key_value_overrides_follow_options(parser):
    args = parse_arguments(parser, ["train", "run.yaml", "--resume", "max_steps=10", "seed=2"])
    assert (args.config, args.resume, args.overrides) == ("run.yaml", True, ["max_steps=10", "seed=2"])
    words = ["parse", "run", "c.yaml", "--train", "t", "--dev", "d", "--resume", "max_steps=5", "--test", "e"]
    args = parse_arguments(parser, words)
    assert (args.config, args.overrides, args.train, args.test) == ("c.yaml", ["max_steps=5"], ["t"], ["e"])


@pytest.mark.parametrize(
    "words,message",
    [
        (["translate", "MODEL", "--no-such-option", "A dog."], "unrecognized arguments: --no-such-option"),
        (["parse", "predict", "MODEL"], "one of the arguments --sentences --trees is required"),
        (["evaluate"], "the following arguments are required: model"),
    ],
)
def test_what_argparse_refuses_is_its_own_message(words, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(words)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--int8", "--quiet"])
def test_the_new_users_commands_translate(tiny_translator, option, capsys):
    """`vaswani-tx translate MODEL --int8 "A dog."` and `... --quiet "A dog."`, as issue 83 wrote them."""
    fast = ["--num-beams", "1", "--max-length-offset", "2", "--device", "cpu"]
    assert main(["translate", str(tiny_translator[0]), option, "A dog.", *fast, "--quiet"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
