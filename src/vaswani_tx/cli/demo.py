"""Serve a Gradio page for a saved model: type a sentence, get the translation `vaswani-tx translate` gives for
the same beam size and length penalty, and look at its attention (encoder self-attention, decoder self-attention,
encoder-decoder attention) by layer and head, with an overview of all heads of a layer.

The page's Translate function is also an API endpoint: gradio_client.Client(URL).predict("A sentence.",
api_name="/translate"). With --write-space DIR --repo-id USER/NAME it writes a Hugging Face Space instead (app.py,
requirements.txt, README.md, the page's code) that serves the same page for the model pushed to USER/NAME.
Needs Gradio, an optional extra: pip install -e '.[demo]'.

examples:
  vaswani-tx demo runs/multi30k-en-de/averaged                       # http://127.0.0.1:7860
  vaswani-tx demo MODEL --port 8080 --int8
  vaswani-tx demo MODEL --host 0.0.0.0                               # every network interface of this machine
  vaswani-tx demo MODEL --write-space my-space --repo-id USER/NAME   # then: huggingface-cli upload --repo-type space ...
"""

from __future__ import annotations

import argparse
import re

from vaswani_tx.cli import fail

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="a saved model folder with its tokenizer (trained, averaged or converted)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, ... (default: the GPU if any)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype; auto: bfloat16 where the CPU or GPU has fast bf16, else float32 (default: as saved)",
    )
    parser.add_argument("--int8", action="store_true", help="int8 linear layers for CPU decoding, as translate --int8")
    space = parser.add_argument_group("a Hugging Face Space instead of a server")
    space.add_argument("--write-space", metavar="DIR", help="write a ready Space for the model into DIR")
    space.add_argument("--repo-id", metavar="USER/NAME", help="the hub repo the Space loads the model from")
    space.add_argument("--force", action="store_true", help="replace DIR when it already holds files")


def unusable_address(host: str, port: int) -> str | None:
    """Why the page cannot be served on host:port (an unknown host, a port in use), before the model loads."""
    import socket

    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no bar
            probe.bind(address)
    except OSError as err:
        return f"cannot serve on {host}:{port} ({err.strerror or err}): give another --port or --host"
    return None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vaswani_tx.demo.demo import build_demo, serve, write_space

    if args.write_space is None:
        if args.repo_id is not None or args.force:
            return fail("demo", "--repo-id and --force go with --write-space DIR")
        if not 1 <= args.port <= 65535:
            return fail("demo", f"--port must be from 1 to 65535, got {args.port}")
        problem = unusable_address(args.host, args.port)
        if problem:
            return fail("demo", problem)
        serve(build_demo(args.model, device=args.device, dtype=args.dtype, int8=args.int8), args.host, args.port)
        return 0
    from vaswani_tx.atomic import atomic_folder
    from vaswani_tx.engine.translation import check_model_folder
    from vaswani_tx.folders import refuse_to_overwrite

    if args.repo_id is None or not REPO_ID.fullmatch(args.repo_id):
        given = "none given" if args.repo_id is None else f"got {args.repo_id!r}"
        return fail("demo", f"--write-space needs --repo-id USER/NAME, the hub repo of the model ({given})")
    check_model_folder(Path(args.model))
    refuse_to_overwrite(args.write_space, args.force)
    with atomic_folder(args.write_space) as partial:
        written = write_space(partial, args.repo_id, model_dir=args.model)
    for path in written:
        print(Path(args.write_space) / path.relative_to(partial))
    return 0
