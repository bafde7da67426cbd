"""`vaswani-tx`: one thin module per command.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only
when its command runs, so ``vaswani-tx --help`` stays fast and a command's heavy imports (datasets,
the Trainer) never slow down another.

Errors are reported in one place, `main()`: a `UserInputError` (a config, corpus, checkpoint, conversion
or folder the command cannot use) or an `OSError` (a file that is missing or unreadable, a full disk, a
refused permission) is one line ``vaswani-tx COMMAND: error: MESSAGE`` and exit status 2; anything else
is a bug, one line naming it and exit status 1, with the traceback under ``--debug``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys

from vaswani_tx.model.errors import UserInputError

# command name -> (module under vaswani_tx.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "params": ("params", "print parameter counts of model configs against the paper's Table 3"),
    "train": ("train", "train a model from a run config (configs/train/*.yaml), resumable"),
    "average-checkpoints": ("average_checkpoints", "average a run's last checkpoints into one model (Section 6.1)"),
    "translate": ("translate", "translate sentences, a file or standard input with a trained model"),
    "evaluate": ("evaluate", "translate a test set and score it (sacreBLEU with signature, chrF, tokenized BLEU)"),
    "attention": ("attention", "draw attention maps per layer and head as PNG (the paper's Figures 3-5)"),
    "demo": ("demo", "serve a Gradio page: translate and see the attention, per layer and head; or write a Space"),
    "train-tokenizer": ("train_tokenizer", "learn a shared BPE or WordPiece vocabulary from parallel text"),
    "prepare-data": ("prepare_data", "clean and encode a parallel corpus into a dataset ready for training"),
    "convert": ("convert", "convert a MarianMT (OPUS-MT), FSMT or fairseq Transformer into a vaswani_tx model folder"),
    "export-marian": ("export_marian", "write a vaswani_tx model folder as a MarianMTModel folder"),
    "export-ct2": ("export_ct2", "convert a saved model to CTranslate2 for fast CPU serving, optionally int8"),
    "parse": ("parse", "constituency parsing (Section 6.3): train on a treebank, parse, score bracketing F1"),
}


def fail(command: str, message: object) -> int:
    """Report bad input (a config, checkpoint, corpus or file a command cannot use) the one way every command
    does: ``vaswani-tx COMMAND: error: MESSAGE`` on stderr; returns the exit status, 2 (argparse's for bad usage).

    `main()` calls it for every `UserInputError` and `OSError` a command lets out; a command calls it itself
    only for a check of its own arguments made before any library call."""
    print(f"vaswani-tx {command}: error: {message}", file=sys.stderr)
    return 2


def add_output_dir_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """The output folder of a command that writes one: ``-o``/``--output-dir DIR`` as in every command, or a
    second positional argument (``convert SRC OUT``, the older spelling); read it with `output_dir`."""
    parser.add_argument("out", nargs="?", metavar="OUT", help=f"{help} (the same as -o)")
    parser.add_argument("-o", "--output-dir", metavar="DIR", help=help)


def output_dir(args: argparse.Namespace) -> str:
    """The folder `add_output_dir_argument` parsed.

    Raises:
        UserInputError: none given, or two different ones (OUT and -o)."""
    given = {path for path in (args.out, args.output_dir) if path}
    if len(given) != 1:
        problem = "no output folder" if not given else f"two output folders ({args.out} and {args.output_dir})"
        raise UserInputError(f"{problem}: give one, as OUT or -o/--output-dir")
    return given.pop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vaswani-tx",
        description="The Transformer of 'Attention Is All You Need' (Vaswani et al., 2017) on Hugging Face.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an unexpected error (default: one line)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"vaswani_tx.cli.{module_name}")
        command_parser = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with the options of the command (or of `parse`'s action) taken before, between
    and after its positional arguments: `translate MODEL --int8 "A dog."`, `train CONFIG --resume k=v`.

    `parse_intermixed_args` does that but cannot take sub-commands, so argparse first reads the whole line as it
    always does (help, unknown commands and missing arguments are its own messages), then the innermost command's
    parser reads its own words again, intermixed. The words before a sub-command's name are flags only (`--debug`),
    so that name is the first word that is not an option."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, _ = parser.parse_known_args(argv)
    level, words = parser, argv
    while True:
        commands = next((a for a in level._actions if isinstance(a, argparse._SubParsersAction)), None)
        if commands is None:
            break
        index = next(i for i, word in enumerate(words) if not word.startswith("-"))
        level, words = commands.choices[words[index]], words[index + 1 :]
    own = {action.dest for action in level._actions}
    outer = argparse.Namespace(**{name: value for name, value in vars(args).items() if name not in own})
    return level.parse_intermixed_args(words, outer)


def describe_os_error(error: OSError) -> str:
    """An `OSError` as one line that names its file: the system's ``[Errno 2] No such file or directory: 'x'``
    becomes ``x: No such file or directory``; one raised with a message of ours (``FileExistsError("output
    folder x already exists ...")``, which sets no ``strerror``) is that message."""
    if error.filename is None or error.strerror is None:
        return str(error)
    files = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
    return f"{files}: {error.strerror}"


class _StderrLines(logging.Handler):
    """Log records as `vaswani-tx COMMAND: message` on whatever sys.stderr is when they come."""

    def __init__(self, command: str):
        super().__init__()
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        print(f"vaswani-tx {self.command}: {record.getMessage()}", file=sys.stderr)


@contextlib.contextmanager
def precision_choices_shown(command: str):
    """While a command runs, what `bf16: auto` and `--dtype auto` chose and why (vaswani_tx.engine.precision's log) goes
    to stderr, one line each."""
    log = logging.getLogger("vaswani_tx.engine.precision")
    saved = log.level, log.propagate
    handler = _StderrLines(command)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.level, log.propagate = saved


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status: 0 done, 1 a bug (an exception no check foresaw), 2 bad input or a
    file the command could not use, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (every file being written
    is removed and what was there before stays, as for Ctrl-C: `vaswani_tx.atomic`).

    `UserInputError` is the package's one family for input a user can fix. `OSError` is caught with it: a
    missing or unreadable file, a full disk or a refused permission is the user's environment, not a bug, and
    the error names the file. Everything else (a ``ValueError`` from torch's shape checks included) is one line
    asking for a report, and ``--debug`` lets it out with its traceback."""
    args = parse_arguments(build_parser(), argv)
    from vaswani_tx.atomic import sigterm_as_interrupt

    stopped: list[int] = []  # SIGTERM raises KeyboardInterrupt, so clean-ups run as for Ctrl-C; exit 128 + 15
    try:
        with sigterm_as_interrupt(stopped), precision_choices_shown(args.command):
            status = int(args._run(args) or 0)
        return 128 + stopped[0] if stopped and status == 130 else status
    except KeyboardInterrupt:  # commands that save work say themselves what was saved
        if args.debug:
            raise
        print(f"vaswani-tx {args.command}: interrupted", file=sys.stderr)
        return 128 + stopped[0] if stopped else 130
    except UserInputError as error:
        return fail(args.command, error)
    except OSError as error:
        return fail(args.command, describe_os_error(error))
    except Exception as error:  # a case no check foresaw: one line, exit 1; --debug shows the traceback
        if args.debug:
            raise
        print(
            f"vaswani-tx {args.command}: error: unexpected {type(error).__name__}: {error} "
            "(run `vaswani-tx --debug ...` for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
