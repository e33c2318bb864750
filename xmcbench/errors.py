"""The one exception type for mistakes a user can make (bad files, bad config, unknown names).

The CLI prints its message as a single line and exits with status 2; anything else is a bug and keeps
its traceback.
"""


class XmcError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it, in one line."""
