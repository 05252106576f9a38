"""Everything the delta layer refuses raises a subclass of :class:`DeltaError`, with a message
naming what failed. A refusal never leaves target weights partly written."""


class DeltaError(Exception):
    """Base of every delta checkpoint refusal."""


class TruncatedError(DeltaError):
    """The bytes end before the structure they describe."""


class BadMagicError(DeltaError):
    """The bytes do not start (or end) with the delta checkpoint magic."""


class UnsupportedFormatError(DeltaError):
    """A format version this code does not read."""


class UnknownCodecError(DeltaError):
    """A tensor names a codec this code does not know."""


class CorruptError(DeltaError):
    """A checksum, hash or internal length does not match."""


class ForeignSegmentError(DeltaError):
    """A segment belongs to another delta."""


class BaseMismatchError(DeltaError):
    """The delta's base version or base weights hash is not what the target holds."""


class LayoutError(DeltaError):
    """A tensor's name, shape or dtype does not match the target weights."""
