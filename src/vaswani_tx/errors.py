"""The one family of exceptions for input a user can fix: a config, corpus, checkpoint, conversion or folder
that a command or library call cannot use.

Every such error derives from `UserInputError`, which the CLI's `main()` catches once (one line on stderr,
exit 2). Anything else that escapes a command is a bug: one line and exit 1, the traceback with `--debug`.
`UserInputError` is a `ValueError`, so library callers that catch ValueError for bad arguments keep working;
torch's own ValueErrors (shape mismatches inside the model) are not user errors and stay bugs.

This file travels with saved weights for `trust_remote_code` (the config and the model raise these errors):
it imports nothing.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Input the user can fix; the message names the field, file or value and what is allowed."""


__all__ = ["UserInputError"]
