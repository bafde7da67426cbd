"""Constituency parsing (paper Section 6.3): treebank reading, normalisation, linearisation, repair, EVALB scoring,
the parser configs, and the `vaswani-tx parse` command end to end on tiny trees."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from vaswani_tx.parsing import parsing
from vaswani_tx.parsing.parsing import (
    PLACEHOLDER,
    Tree,
    TreebankFormatError,
    bracket_f1,
    delinearize,
    linearize,
    normalize_tree,
    parse_tree,
    read_treebank,
    replace_tags,
)

REPO = Path(__file__).resolve().parents[1]

# Two trees in .mrg style: over several lines, function tags, indices, gapping, empty elements, -LRB-,
# "((" without a space, and a tree that is only an empty element once its S is emptied.
MRG = """
( (S
    (NP-SBJ-1 (DT The) (NN dog) )
    (VP (VBD was)
      (VP (VBN seen)
        (NP (-NONE- *-1) )
        (PP-LOC (IN in)
          (NP (-LRB- -LRB-) (NN park) (-RRB- -RRB-) ))))
    (. .) ))
((S (NP-SBJ=2 (PRP It) ) (VP (VBZ rains) ) (, ,) (ADVP-TMP (RB again) ) (. .) ))
"""
MRG_NORMALIZED = [
    "(S (NP (DT The) (NN dog)) (VP (VBD was) (VP (VBN seen) (PP (IN in) (NP (-LRB- -LRB-) (NN park) (-RRB- -RRB-))))) (. .))",
    "(S (NP (PRP It)) (VP (VBZ rains)) (, ,) (ADVP (RB again)) (. .))",
]


@pytest.fixture(scope="module")
def tiny_treebank(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("treebank") / "tiny.mrg"
    path.write_text(MRG, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sample_raw_trees(shared_data) -> list[Tree]:
    folder = shared_data / "treebank-sample" / "combined"
    if not folder.is_dir():
        pytest.skip(f"treebank sample not found at {folder}")
    return read_treebank(folder / "*.mrg", normalize=False)


# --- reading and normalisation ---------------------------------------------------------------------------------


def test_mrg_trees_are_read_and_normalised(tiny_treebank):
    raw = read_treebank(tiny_treebank, normalize=False)
    assert [tree.line for tree in raw] == [2, 10]
    assert raw[0].label == "" and raw[0].children[0].label == "S"
    assert [str(tree) for tree in read_treebank(tiny_treebank)] == MRG_NORMALIZED
    # one tree per line reads the same, and normalising twice changes nothing
    one_per_line = tiny_treebank.with_name("lines.txt")
    one_per_line.write_text("".join(f"{tree}\n" for tree in raw), encoding="utf-8")
    assert read_treebank(one_per_line) == read_treebank(tiny_treebank)
    assert [normalize_tree(t) for t in read_treebank(tiny_treebank)] == read_treebank(tiny_treebank)


def test_function_tags_are_stripped_but_bracket_tokens_kept():
    from vaswani_tx.metrics.vaswani_parseval.vaswani_parseval import strip_function_tags

    cases = {
        "NP-SBJ-1": "NP",
        "NP=2": "NP",
        "PP-LOC-CLR": "PP",
        "S": "S",
        "WHNP-1": "WHNP",
        "-LRB-": "-LRB-",
        "-NONE-": "-NONE-",
        "PRT|ADVP": "PRT|ADVP",
    }
    assert {label: strip_function_tags(label) for label in cases} == cases


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("(S (NP (DT a) (NN b))\n(VP (VB c)))\n)", "f.mrg:3:1", "closes no open bracket"),
        ("\n( (S (NP (DT a)) (VP (VB c))\n", "f.mrg:2:1", "never closed"),
        ("(S (NP (DT a)))\nstray (S (NN b))", "f.mrg:2:1", "outside any bracket"),
        ("(S (NP (DT a) (NN b))\n  (VP ))", "f.mrg:2:7", "no children"),
        ("(S (NP (DT a) b))", "f.mrg:1:16", "mixes the word 'b'"),
    ],
)
def test_malformed_brackets_name_file_line_and_column(tmp_path, text, where, what):
    path = tmp_path / "f.mrg"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TreebankFormatError) as error:
        read_treebank(path)
    assert str(error.value).startswith(f"{tmp_path / where}:") and what in str(error.value)


def test_missing_treebank_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no treebank file matches"):
        read_treebank(str(tmp_path / "*.mrg"))


# --- linearisation and repair ----------------------------------------------------------------------------------


def test_word_leaves_linearise_with_the_words_and_read_back():
    tree = parse_tree("(S (NP (DT The) (NN dog)) (VP (VBD barked)) (. .))")
    assert linearize(tree, words=True) == ["(S", "(NP", "The", "dog", ")NP", "(VP", "barked", ")VP", ".", ")S"]
    assert delinearize(linearize(tree, words=True), tree.words()) == replace_tags(tree)


def test_linearisation_is_vinyals_et_al(tiny_treebank):
    tree = read_treebank(tiny_treebank)[1]
    assert linearize(tree) == ["(S", "(NP", "XX", ")NP", "(VP", "XX", ")VP", "XX", "(ADVP", "XX", ")ADVP", "XX", ")S"]
    assert linearize(tree, tags=True) == [
        "(S",
        "(NP",
        "PRP",
        ")NP",
        "(VP",
        "VBZ",
        ")VP",
        ",",
        "(ADVP",
        "RB",
        ")ADVP",
        ".",
        ")S",
    ]
    assert parsing.tree_to_example(tree) == ("It rains , again .", "(S (NP XX )NP (VP XX )VP XX (ADVP XX )ADVP XX )S")


def _round_trip_holds(tree: Tree) -> bool:
    words = tree.words()
    return (
        delinearize(linearize(tree), words) == replace_tags(tree, PLACEHOLDER)
        and delinearize(linearize(tree, tags=True), words, tags=True) == tree
        and parse_tree(str(tree)) == tree
    )


def test_round_trip_is_the_identity_on_tiny_trees(tiny_treebank):
    trees = read_treebank(tiny_treebank) + [
        normalize_tree(parse_tree("( (NN Hello) )")),  # a one-word sentence keeps its unlabelled root
        parse_tree("( (NP (NN a)) (VP (VB b)) )"),  # several top constituents under the root
        parse_tree("(S (NP (NP (NN dogs))) (VP (VBP bark)))"),  # a unary chain
    ]
    assert all(_round_trip_holds(tree) for tree in trees)


def test_round_trip_is_the_identity_on_every_sample_tree_and_gold_f1_is_100(sample_raw_trees):
    trees = [normalize_tree(tree) for tree in sample_raw_trees]
    assert len(trees) == 3669 and all(tree.children for tree in trees)
    assert all(_round_trip_holds(tree) for tree in trees)
    scores = bracket_f1(sample_raw_trees, trees)  # raw trees are normalised by the scorer
    assert scores["f1"] == scores["precision"] == scores["recall"] == scores["exact_match"] == 100.0
    assert scores["sentences"] == 3669 and scores["gold_brackets"] > 60_000


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ("(S (NP XX XX )NP (VP XX )VP )S", "(S (NP (XX a) (XX b)) (VP (XX c)))"),
        ("(S (NP XX XX (VP XX", "(S (NP (XX a) (XX b) (VP (XX c))))"),  # brackets left open are closed
        (
            ")S )NP (S (NP XX XX )NP )NP )S (VP XX )VP )VP",
            "( (S (NP (XX a) (XX b))) (VP (XX c)))",
        ),  # stray closes dropped
        ("(S (NP XX XX XX XX XX )NP )S", "(S (NP (XX a) (XX b) (XX c)))"),  # extra placeholders dropped
        ("(S (NP XX )NP )S", "(S (NP (XX a)) (XX b) (XX c))"),  # missing words join the last top constituent
        ("XX (NP XX )NP", "( (XX a) (NP (XX b) (XX c)))"),
        ("(S (NP )NP (VP XX XX XX )VP (PP )PP )S", "(S (VP (XX a) (XX b) (XX c)))"),  # empty constituents removed
        ("", "( (XX a) (XX b) (XX c))"),
        ("( ) (( (S XX XX XX )S", "(S (XX a) (XX b) (XX c))"),  # a bare bracket names nothing
        ("(S XX XX XX )VP", "(S (XX a) (XX b) (XX c))"),  # the closing label is not checked
    ],
)
def test_repair(tokens, expected):
    assert str(delinearize(tokens, ["a", "b", "c"])) == expected


def test_repair_of_random_sequences_always_gives_a_tree_over_the_words():
    rng = random.Random(0)
    vocabulary = [
        "(S",
        "(NP",
        "(VP",
        "(PP",
        ")S",
        ")NP",
        ")VP",
        ")PP",
        "XX",
        "XX",
        "(",
        ")",
        "((",
        "))",
        "(A(B",
        "dog",
        "<unk>",
        "▁",
        ")XX",
        "(XX",
        "NN",
        "é",
    ]
    for _ in range(500):
        words = [f"w{i}" for i in range(rng.randint(1, 12))]
        tokens = [rng.choice(vocabulary) for _ in range(rng.randint(0, 40))]
        for tags in (False, True):
            tree = delinearize(tokens, words, tags=tags)
            assert tree.words() == words, (tokens, words)
            assert parse_tree(str(tree)) == tree  # well-formed: it prints as brackets that read back
            assert bracket_f1([parse_tree(f"(S {' '.join(f'(NN {w})' for w in words)})")], [tree])["sentences"] == 1


# --- scoring ---------------------------------------------------------------------------------------------------


def test_f1_ignores_punctuation_and_root():
    gold = "( (S (NP (DT The) (NN dog)) (VP (VBZ barks)) (. .)) )"
    predicted = "(TOP (S (NP (XX The) (XX dog)) (VP (XX barks) (XX .))))"  # VP takes the period
    scores = bracket_f1([gold], [predicted])
    assert (scores["matched_brackets"], scores["gold_brackets"], scores["predicted_brackets"]) == (3, 3, 3)
    assert scores["f1"] == 100.0 and scores["exact_match"] == 100.0
    # a constituent of punctuation only is no bracket at all
    scores = bracket_f1(["(S (NP (NN Yes)) (. .))"], ["(S (NP (XX Yes)) (X (XX .)))"])
    assert scores["predicted_brackets"] == 2 and scores["f1"] == 100.0


def test_advp_and_prt_are_one_label():
    gold = "(S (NP (PRP He)) (VP (VBD gave) (PRT (RP up))))"
    assert bracket_f1([gold], ["(S (NP (XX He)) (VP (XX gave) (ADVP (XX up))))"])["f1"] == 100.0
    assert bracket_f1([gold], ["(S (NP (XX He)) (VP (XX gave) (ADJP (XX up))))"])["matched_brackets"] == 3


def test_duplicate_brackets_count_as_a_multiset():
    gold = "(S (NP (NP (NNS dogs))) (VP (VBP bark)))"  # S, NP, NP, VP: 4 brackets
    scores = bracket_f1([gold], ["(S (NP (XX dogs)) (VP (XX bark)))"])
    assert (scores["matched_brackets"], scores["gold_brackets"], scores["predicted_brackets"]) == (3, 4, 3)
    assert scores["precision"] == 100.0 and scores["recall"] == 75.0
    assert scores["f1"] == pytest.approx(2 * 100 * 75 / 175) and scores["exact_match"] == 0.0


def test_crossing_brackets():
    gold = "(S (NP (DT a) (NN b)) (VP (VB c) (NP (NN d))))"  # S 0-4, NP 0-2, VP 2-4, NP 3-4
    predicted = "(S (XX a) (X (XX b) (XX c)) (XX d))"  # S 0-4, X 1-3 crosses NP 0-2 and VP 2-4
    scores = bracket_f1([gold], [predicted])
    assert scores["precision"] == 50.0 and scores["recall"] == 25.0
    assert scores["f1"] == pytest.approx(100 / 3)
    assert scores["average_crossing"] == 1.0 and scores["no_crossing"] == 0.0


def test_corpus_totals_and_length_cutoff():
    gold = ["(S (NP (NN a)) (VP (VB b)))", "(S (NP (NN a) (NN b) (NN c)) (VP (VB d)))"]
    predicted = ["(S (NP (XX a)) (VP (XX b)))", "(S (XX a) (VP (XX b) (XX c) (XX d)))"]
    scores = bracket_f1(gold, predicted)  # 3 + 1 matched of 3 + 3 gold, 3 + 2 predicted
    assert (scores["matched_brackets"], scores["gold_brackets"], scores["predicted_brackets"]) == (4, 6, 5)
    assert scores["precision"] == 80.0 and scores["exact_match"] == 50.0
    assert bracket_f1(gold, predicted, max_length=3)["sentences"] == 1


def test_different_words_are_refused():
    with pytest.raises(ValueError, match="sentence 1: the gold tree has 2 words, the predicted tree 1"):
        bracket_f1(["(S (NN a) (NN b))"], ["(S (XX a))"])
    with pytest.raises(ValueError, match="1 gold trees but 2 predicted"):
        bracket_f1(["(S (NN a))"], ["(S (XX a))", "(S (XX a))"])


def test_evaluate_module_gives_the_same_scores():
    from vaswani_tx.metrics.evaluation import load_metric

    gold = ["(S (NP (NP (NNS dogs))) (VP (VBP bark)))", "( (S (NP (DT a) (NN b)) (VP (VB c) (NP (NN d)))) )"]
    predicted = ["(S (NP (XX dogs)) (VP (XX bark)))", "(S (XX a) (X (XX b) (XX c)) (XX d))"]
    metric = load_metric("vaswani_parseval")
    assert metric.compute(predictions=predicted, references=gold) == bracket_f1(gold, predicted)
    assert load_metric().name == "vaswani_bleu"  # the default is still the translation metric
    with pytest.raises(ValueError, match="unknown metric"):
        load_metric("bleu")


# --- configs ---------------------------------------------------------------------------------------------------


def test_parser_configs_are_section_6_3():
    from vaswani_tx.metrics.paper import PARSER_GENERATION
    from vaswani_tx.training.params import load_model_config
    from vaswani_tx.training.run_config import load_run_config

    wsj = load_model_config(REPO / "configs" / "model" / "parser-wsj.json")
    assert (wsj.num_encoder_layers, wsj.num_decoder_layers, wsj.d_model, wsj.vocab_size) == (4, 4, 1024, 16000)
    assert (wsj.d_ff, wsj.num_heads, wsj.tie_word_embeddings) == (2048, 8, True)  # the rest as base
    assert PARSER_GENERATION == {
        "num_beams": 21,
        "length_penalty": 0.3,
        "length_penalty_type": "gnmt",
        "max_output_length_offset": 300,
    }
    gpu_only = {} if torch.cuda.is_available() else {"bf16": False, "use_cpu": True}  # bf16 needs a GPU to construct
    for name in ("wsj-parse", "wsj-parse-cpu"):
        recipe, arguments = load_run_config(REPO / "configs" / "train" / f"{name}.yaml", gpu_only, world_size=8)
        # the CPU recipe's targets have the words as leaves and its rare words are classes (docs/parsing.md); the
        # GPU recipe is the paper's
        leaves = {"tree_leaves": "words", "unknown_words": "classes"} if name == "wsj-parse-cpu" else {}
        assert recipe.generation == {**PARSER_GENERATION, **leaves}
        assert yaml.safe_load((REPO / "configs" / "train" / f"{name}.yaml").read_text())["model_config"].startswith(
            "configs/model/parser-"
        )
        assert arguments.label_smoothing_factor == 0.1 and arguments.predict_with_generate is False
        if name == "wsj-parse":  # the base model's Section 5 training: 25,000 tokens a step on 8 GPUs, 100K steps
            assert recipe.max_tokens * 8 * arguments.gradient_accumulation_steps == 25_000
            assert (arguments.max_steps, arguments.warmup_steps, arguments.learning_rate) == (100_000, 4000, 1.0)
    assert recipe.model_config.endswith("parser-cpu.json")


def test_generation_block_becomes_the_saved_generation_config(tmp_path):
    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani_tx.metrics.paper import PARSER_GENERATION
    from vaswani_tx.parsing.parse_run import set_parser_generation_defaults
    from vaswani_tx.training.run_config import ConfigError

    model = VaswaniForConditionalGeneration(
        VaswaniConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1, num_decoder_layers=1)
    )
    set_parser_generation_defaults(model, {**PARSER_GENERATION, "tree_leaves": "words"})  # the parser's own field too
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert {key: saved[key] for key in PARSER_GENERATION} == PARSER_GENERATION and saved["tree_leaves"] == "words"
    with pytest.raises(ConfigError, match="num_beam"):
        set_parser_generation_defaults(model, {"num_beam": 21})


# --- the command, end to end on tiny trees ---------------------------------------------------------------------

TINY_TREES = [
    "(S (NP (DT the) (NN dog)) (VP (VBZ runs)) (. .))",
    "(S (NP (DT a) (NN cat)) (VP (VBZ sleeps) (PP (IN on) (NP (DT the) (NN mat)))) (. .))",
    "(S (NP (PRP it)) (VP (VBZ rains)))",
    "(NP (DT the) (JJ big) (NN dog))",
]


def test_parse_command_trains_parses_and_scores(tmp_path, monkeypatch):
    from vaswani_tx import VaswaniConfig
    from vaswani_tx.cli import main
    from vaswani_tx.data.tokenization import train_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "trees.txt").write_text("".join(t + "\n" for t in TINY_TREES * 3), encoding="utf-8")
    (tmp_path / "test.mrg").write_text("".join(t + "\n" for t in TINY_TREES[:2]), encoding="utf-8")
    parsing.write_examples(read_treebank("trees.txt"), "data/train.words", "data/train.tree")
    tokenizer = train_tokenizer(["data/train.words", "data/train.tree"], "word", 300, show_progress=False)
    tokenizer.save_pretrained("tokenizer")
    config = VaswaniConfig(
        vocab_size=len(tokenizer), d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1, num_decoder_layers=1
    ).to_dict()
    Path("model.json").write_text(
        json.dumps({k: config[k] for k in json.loads((REPO / "configs" / "model" / "tiny-cpu.json").read_text())})
    )
    run_config = yaml.safe_load((REPO / "configs" / "train" / "wsj-parse-cpu.yaml").read_text())
    run_config.update(
        model_config="model.json",
        tokenizer="tokenizer",
        output_dir="run",
        max_steps=4,
        warmup_steps=2,
        save_steps=2,
        eval_steps=2,
        report_to="none",
        train_source="data/train.words",
        train_target="data/train.tree",
        dev_source="data/dev.words",
        dev_target="data/dev.tree",
    )
    Path("run.yaml").write_text(yaml.safe_dump(run_config))

    # decoding is shortened through the generation block (the real configs keep Section 6.3's)
    short = "generation={num_beams: 3, length_penalty: 0.3, length_penalty_type: gnmt, max_output_length_offset: 8}"
    assert (
        main(["parse", "run", "run.yaml", "--train", "trees.txt", "--dev", "trees.txt", "--test", "test.mrg", short])
        == 0
    )
    scores = json.loads(Path("run/parse_scores.json").read_text())
    assert scores["test_trees"] == 2 and scores["model"] == "run/averaged" and 0.0 <= scores["f1"] <= 100.0
    assert json.loads(Path("run/averaged/generation_config.json").read_text())["num_beams"] == 3
    parsed = read_treebank("run/test.parsed")
    assert [tree.words() for tree in parsed] == [tree.words() for tree in read_treebank("test.mrg")]
    assert scores["constrained"] is True and "f1_40" in scores and scores["seconds"] > 0
    dev_f1 = [e for e in json.loads(Path("run/log_history.json").read_text()) if "eval_bracket_f1" in e]
    assert [e["step"] for e in dev_f1] == [2, 4] and all(0 <= e["eval_bracket_f1"] <= 100 for e in dev_f1)
    assert dev_f1[1]["train_minutes"] >= dev_f1[0]["train_minutes"] >= 0 and Path("run/curves.png").is_file()

    assert main(["parse", "score", "test.mrg", "test.mrg"]) == 0
    Path("sentences.txt").write_text("the dog runs .\nit rains\n", encoding="utf-8")
    assert (
        main(
            [
                "parse",
                "predict",
                "run/averaged",
                "--sentences",
                "sentences.txt",
                "--num-beams",
                "2",
                "--output",
                "out.txt",
            ]
        )
        == 0
    )
    assert [tree.words() for tree in read_treebank("out.txt")] == [["the", "dog", "runs", "."], ["it", "rains"]]
    argv = ["parse", "predict", "run/averaged", "--sentences", "sentences.txt", "--unconstrained", "-o", "plain.txt"]
    assert main([*argv, "--num-beams", "2"]) == 0
    assert [tree.words() for tree in read_treebank("plain.txt")] == [["the", "dog", "runs", "."], ["it", "rains"]]
    monkeypatch.setattr("sys.stdin", io.StringIO("the dog runs .\n"))  # the --help example: --sentences -
    assert main(["parse", "predict", "run/averaged", "--sentences", "-", "--num-beams", "2", "-o", "stdin.txt"]) == 0
    assert [tree.words() for tree in read_treebank("stdin.txt")] == [["the", "dog", "runs", "."]]


def test_parse_run_refuses_a_vocabulary_constrained_decoding_cannot_use_before_training(tmp_path, capsys):
    from vaswani_tx.cli import main

    (tmp_path / "trees.txt").write_text("".join(t + "\n" for t in TINY_TREES), encoding="utf-8")
    argv = ["parse", "run", str(REPO / "configs" / "train" / "wsj-parse.yaml"), "--train", str(tmp_path / "trees.txt")]
    argv += [
        "--dev",
        str(tmp_path / "trees.txt"),
        "--test",
        str(tmp_path / "trees.txt"),
        f"output_dir={tmp_path / 'run'}",
    ]
    argv += [f"tokenizer={tmp_path / 'tok'}", "bf16=false", "use_cpu=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs a word-level vocabulary" in err and "--unconstrained" in err and "bpe" in err
    assert not (tmp_path / "run").exists()


def test_parse_command_reports_bad_trees_with_file_and_line(tmp_path, capsys):
    from vaswani_tx.cli import main

    good, bad = tmp_path / "gold.mrg", tmp_path / "bad.mrg"
    good.write_text(TINY_TREES[0] + "\n", encoding="utf-8")
    bad.write_text("\n(S (NP (DT the) (NN dog)) (VP (VBZ runs))\n", encoding="utf-8")
    assert main(["parse", "score", str(good), str(bad)]) == 2
    assert f"error: {bad}:2:1: '(' opened here is never closed" in capsys.readouterr().err
    assert main(["parse", "score", str(good), str(tmp_path / "missing.mrg")]) == 2
    assert "missing.mrg does not exist" in capsys.readouterr().err


# --- rare and unseen words as classes (unknown_words: classes) --------------------------------------------------


@pytest.mark.parametrize(
    "word, expected",
    [
        ("dog", "<unk-LOW>"),
        ("running", "<unk-LOW-ing>"),
        ("Smithfield", "<unk-CAP>"),
        ("Cheerfully", "<unk-CAP-ly>"),
        ("iPhones", "<unk-MIXCAP-s>"),
        ("1,234", "<unk-DIG>"),
        ("B-52s", "<unk-CAP-DIG-DASH>"),
        ("well-meaning", "<unk-LOW-DASH-ing>"),
        ("is", "<unk-LOW>"),  # a suffix needs a stem of two letters or more
        ("&", "<unk-OTHER>"),
    ],
)
def test_word_class_is_the_shape_of_the_word(word, expected):
    assert parsing.word_class(word) == expected
    assert not parsing.word_class(word).startswith(("(", ")")) and parsing.word_class(word) != "<unk>"


def test_known_words_keep_the_frequent_ones_that_fit_beside_brackets_and_classes():
    trees = [parse_tree(t) for t in TINY_TREES * 2] + [parse_tree("(S (NP (NNP Kim)) (VP (VBD walked)))")]
    # seen twice or more: the dog runs . a cat sleeps on mat it rains big (11); once: Kim walked
    every = parsing.known_words(trees, vocab_size=1000, reserved=4)
    assert every == {"the", "dog", "runs", ".", "a", "cat", "sleeps", "on", "mat", "it", "rains", "big"}
    # 4 special tokens, 8 brackets, and room for 7: the classes <unk-CAP> and <unk-LOW-ed> (Kim, walked), then
    # <unk-LOW> and <unk-LOW-s> once cat, runs... are left out, so 3 words: the most frequent (the 6, "." and dog 4)
    tight = parsing.known_words(trees, vocab_size=4 + 8 + 7, reserved=4, copies=2)
    assert tight == {"the", ".", "dog"}
    # written once each (copies=1) Kim's and walked's classes fall under the trainer's min_count and take no place
    assert parsing.known_words(trees, vocab_size=4 + 8 + 7, reserved=4) == {"the", ".", "dog", "a", "big"}
    mapped = parsing.replace_rare_words(trees[-1], tight)
    assert mapped.words() == ["<unk-CAP>", "<unk-LOW-ed>"] and str(trees[-1]).count("Kim") == 1


def test_parse_run_with_word_classes_learns_them_and_parses_unseen_words(tmp_path, monkeypatch):
    from transformers import GenerationConfig

    from vaswani_tx.cli import main
    from vaswani_tx.data.tokenization import load_tokenizer

    monkeypatch.chdir(tmp_path)
    trees = TINY_TREES * 3 + ["(S (NP (NNP Kim)) (VP (VBD walked)))", "(S (NP (NNP Lee)) (VP (VBD talked)))"]
    Path("trees.txt").write_text("".join(t + "\n" for t in trees), encoding="utf-8")
    Path("test.mrg").write_text("(S (NP (NNP Pat)) (VP (VBD jumped) (. .)))\n", encoding="utf-8")
    config = json.loads((REPO / "configs" / "model" / "tiny-cpu.json").read_text())
    # 4 special tokens, 8 brackets, 12 words seen 3 times or more, 2 classes: 26; 24 leaves room for 10 words only
    Path("model.json").write_text(json.dumps({**config, "vocab_size": 24, "d_model": 16, "d_ff": 24}))
    run_config = yaml.safe_load((REPO / "configs" / "train" / "wsj-parse-cpu.yaml").read_text())
    run_config.update(
        model_config="model.json", tokenizer="run/tokenizer", output_dir="run", max_steps=2, warmup_steps=1,
        save_steps=2, eval_steps=2, report_to="none", train_source="data/train.words",
        train_target="data/train.tree", dev_source="data/dev.words", dev_target="data/dev.tree",
    )  # fmt: skip
    run_config["generation"] = {**run_config["generation"], "num_beams": 2, "unknown_words": "classes"}
    Path("run.yaml").write_text(yaml.safe_dump(run_config))
    argv = ["parse", "run", "run.yaml", "--train", "trees.txt", "--dev", "trees.txt", "--test", "test.mrg"]
    assert main(argv) == 0
    # words seen once are written as their classes, which the vocabulary then holds
    assert Path("data/train.words").read_text().splitlines()[-2:] == ["<unk-CAP> <unk-LOW-ed>"] * 2
    vocabulary = load_tokenizer("run/tokenizer").get_vocab()
    assert {"<unk-CAP>", "<unk-LOW-ed>"} <= set(vocabulary) and len(vocabulary) == 24
    # the least frequent words (ties by spelling) make room for the classes: rains, runs, sleeps are <unk-LOW-s>
    assert "<unk-LOW-s>" in vocabulary and not {"rains", "runs", "sleeps"} & set(vocabulary)
    assert GenerationConfig.from_pretrained("run/averaged").unknown_words == "classes"
    # the unseen words are read as classes and the tree keeps the words themselves
    assert read_treebank("run/test.parsed")[0].words() == ["Pat", "jumped", "."]
    from vaswani_tx.parsing.tree_decoding import _with_classes

    tokenizer = load_tokenizer("run/tokenizer")
    mapped = _with_classes([["Pat", "jumped", "the", "zz9"]], tokenizer)
    assert mapped == [["<unk-CAP>", "<unk-LOW-ed>", "the", "zz9"]]  # no <unk-LOW-DIG> class: stays <unk>


def test_bad_unknown_words_setting_is_refused_before_training(tmp_path, capsys):
    from vaswani_tx.cli import main

    (tmp_path / "trees.txt").write_text("".join(t + "\n" for t in TINY_TREES), encoding="utf-8")
    argv = [
        "parse",
        "run",
        str(REPO / "configs" / "train" / "wsj-parse-cpu.yaml"),
        "--train",
        str(tmp_path / "trees.txt"),
    ]
    argv += ["--dev", str(tmp_path / "trees.txt"), "--test", str(tmp_path / "trees.txt")]
    argv += [f"output_dir={tmp_path / 'run'}", f"tokenizer={tmp_path / 'tok'}", "generation={unknown_words: rare}"]
    assert main(argv) == 2
    assert "unknown_words='rare' is not one of ('unk', 'classes')" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --- determinism: the same run twice gives the same bytes -------------------------------------------------------


def _parse_run_in(folder: Path, seed: str) -> None:
    import os
    import subprocess
    import sys

    folder.mkdir()
    trees = [t for t in TINY_TREES * 4] + ["(S (NP (NNP Kim)) (VP (VBD walked)) (. .))"]
    (folder / "trees.txt").write_text("".join(t + "\n" for t in trees), encoding="utf-8")
    config = json.loads((REPO / "configs" / "model" / "tiny-cpu.json").read_text())  # dropout 0.1: random masks
    # 4 special tokens, 8 brackets, 14 words (Kim and walked twice: as source and leaf)
    (folder / "model.json").write_text(json.dumps({**config, "vocab_size": 26, "d_model": 32, "d_ff": 64}))
    run_config = yaml.safe_load((REPO / "configs" / "train" / "wsj-parse-cpu.yaml").read_text())
    run_config.update(
        model_config="model.json", tokenizer="run/tokenizer", output_dir="run", max_steps=6, warmup_steps=2,
        save_steps=2, eval_steps=3, max_tokens=40, report_to="none", train_source="data/train.words",
        train_target="data/train.tree", dev_source="data/dev.words", dev_target="data/dev.tree",
    )  # fmt: skip
    run_config["generation"] = {**run_config["generation"], "num_beams": 3}
    (folder / "run.yaml").write_text(yaml.safe_dump(run_config))
    # a fresh process each, with its own string hashing: nothing may depend on set or dict order
    env = {**os.environ, "PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = ["parse", "run", "run.yaml", "--train", "trees.txt", "--dev", "trees.txt", "--test", "trees.txt"]
    done = subprocess.run(
        [sys.executable, "-m", "vaswani_tx.cli", *argv], cwd=folder, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _without_times(value):
    """A trainer state or log with the wall-clock fields (runtimes, rates, minutes, seconds) left out."""
    if isinstance(value, dict):
        timed = ("runtime", "per_second", "minutes", "seconds")
        return {k: _without_times(v) for k, v in value.items() if not any(t in k for t in timed)}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def test_two_parse_runs_give_the_same_checkpoints_byte_for_byte_and_the_same_f1(tmp_path):
    _parse_run_in(tmp_path / "one", "1")
    _parse_run_in(tmp_path / "two", "2")
    one, two = tmp_path / "one", tmp_path / "two"
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert any(p.name == "optimizer.pt" for p in files) and Path("run/averaged/model.safetensors") in files
    timed = {"trainer_state.json", "log_history.json", "parse_scores.json", "averaged_from.json"}
    for path in files:
        if path.name in timed:
            assert _without_times(json.loads((one / path).read_text())) == _without_times(
                json.loads((two / path).read_text())
            ), path
        elif path.suffix not in (".png", ".bin"):  # the plot's metadata; training_args.bin holds no result
            assert (one / path).read_bytes() == (two / path).read_bytes(), path
    scores = json.loads((one / "run" / "parse_scores.json").read_text())
    assert scores["f1"] == json.loads((two / "run" / "parse_scores.json").read_text())["f1"]
    dev_f1 = [e for e in json.loads((one / "run" / "log_history.json").read_text()) if "eval_bracket_f1" in e]
    assert [e["step"] for e in dev_f1] == [3, 6]
