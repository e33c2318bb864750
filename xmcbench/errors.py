"""The one exception type for mistakes a user can make (bad files, bad config, unknown names).

The CLI prints its message as a single line and exits with status 2; anything else is a bug and keeps
its traceback.
"""

import difflib


class XmcError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it, in one line."""


class TrainingInterrupted(XmcError):
    """Ctrl-C during training: a checkpoint was written first (the CLI exits with status 130)."""


# The kinds of XmcError an API user may want to tell apart; each keeps the one-line message of its raise site.

class UnknownName(XmcError):
    """A method, component, dataset, data format, logger, executor or setting that is not registered."""


class RefusedSetting(XmcError):
    """A setting (--set, --config, a method option, a reading flag) with a value that cannot be used."""


class BadData(XmcError):
    """A dataset's files (or rows given in memory) that are missing or cannot be read as they are."""


class DamagedModel(XmcError):
    """A saved model, label index, checkpoint, prediction file or ensemble that is missing, incomplete or changed
    since it was written."""


def first_line(text: object) -> str:
    """The first non-blank line of str(text), stripped ("" when there is none)."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def error_line(error: BaseException) -> str:
    """`TypeName: first line of the message` (the type alone when the message is empty): an exception that
    is not an XmcError, reported in one line."""
    line = first_line(error)
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def joined_line(text: object) -> str:
    """str(text) on one line: every run of whitespace, line breaks included, becomes one space."""
    return " ".join(str(text).split())


def closest_names_hint(name: str, choices) -> str:
    """The end of an "unknown NAME" line: the closest of `choices`, or all of them."""
    if not choices:
        return "none is registered"
    matches = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.4)
    if matches:
        return "did you mean " + ", ".join(repr(m) for m in matches) + "?"
    return "valid names: " + ", ".join(sorted(choices))
