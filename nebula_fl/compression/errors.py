"""The one error type of the compression library: a bad spec, a bad input, or a blob that cannot be trusted."""

from __future__ import annotations

from nebula_fl.errors import NebulaError


class CodecError(NebulaError, ValueError):
    """A codec spec, an input or an encoded blob is invalid; the message says what, where and how to fix.

    Decoding raises only this, whatever the bytes: a caller that catches CodecError can drop a hostile
    or corrupt message and carry on.
    """
