"""Error types shared by the node, the attestation code and the verifier.

Every error the user can cause is a :class:`BitexactError`; the CLI prints its
message as one line and exits with its ``exit_code``.
"""


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (line breaks, terminal
    escape sequences, other controls) written as a Python string literal writes
    it (``\\n``, ``\\x1b``), so a message quoting a model file or a request stays
    one line and cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class BitexactError(Exception):
    """Input that cannot be processed (exit code 2)."""

    exit_code = 2


class ModelError(BitexactError):
    """A GGUF file that is missing, unreadable or uses an unsupported feature."""


class RequestError(BitexactError):
    """A request parameter outside its documented range; ``param`` names the
    request field at fault and ``code`` the OpenAI error code (e.g.
    ``context_length_exceeded``), when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class LimitError(RequestError):
    """A request that ran past a limit of the machine handling it (the chat
    template's time or memory): the daemon answers it like any bad request,
    but a verifier cannot conclude from it that the node refused it."""


class AttestationError(BitexactError):
    """An attestation file that is truncated, corrupt, tampered or untrusted."""


class KeyError_(BitexactError):
    """A signing key that is missing, unreadable or locked with another passphrase."""


class NumericFault(BitexactError):
    """A NaN appeared in the forward pass; NaN bit patterns differ across devices."""
