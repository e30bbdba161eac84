"""The one exception type that reaches users.

Everything a user can cause (a missing or malformed file, an unsupported shape, an invalid config key)
raises :class:`RLFlowError` with a one-line message naming the cause (file, node, op type or key).
The CLI prints it as ``rlflow: error: <message>`` and exits with status 2, without a traceback.
"""


class RLFlowError(Exception):
    """A user-facing error: the message is one line that names the cause."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line
