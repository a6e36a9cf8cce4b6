"""What the IO side asks of a codec: frames in, decoded messages and error replies out.

Rules:
- Protocols only: the codec object is handed in (``controller/codec.py``'s ``JsonCodec``, or
  an embedder's own, wrapped in ``GuardedCodec``); nothing here decodes anything.
- The IO thread calls ``decode`` on every frame it reads and ``encode_error`` for the error
  replies to bad input it makes itself (only for a feed whose replies are ``all``; None from it
  declines the frame); encoding results is the main thread's business.
- ``decode`` never raises and returns the good messages column-wise (``seq``, ``stream``,
  ``x`` [n, F] in the processor's input dtype, float32 by default), which the hand-over
  gathers into ``Chunk``s (io_loop/handover.py), and one ``(reason, seq)`` per bad part in
  ``errors``.
- The accepted range of ``x`` is one for every way in (``X_MAX``): the codec refuses a value
  outside it as bad input (``X_RANGE_REASON``), and so does ``SourceContext.emit_rows``
  (io_loop/source.py) for rows a source decoded itself.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["NOT_NUMBERS_REASON", "X_MAX", "X_RANGE_REASON", "DecodedFrame", "FrameDecoder"]

# The accepted input range: |x| <= X_MAX. Within it the default detector's float32
# arithmetic cannot overflow (d = x - mean <= 2e18, d**2 <= 4e36 < float32's 3.4e38), so a
# stream's state stays finite; a larger value is refused as bad input with its own reason.
X_MAX = 1e18
X_RANGE_REASON = "x must be finite and within ±1e18"
NOT_NUMBERS_REASON = "x must hold numbers only"  # None, a str, a bool where a number belongs


class DecodedFrame(Protocol):
    """What one frame held (``controller.codec.Decoded`` is the one the codecs return)."""

    seq: list[Any]
    stream: list[str]
    x: Any  # [n, F], the processor's input dtype (float32 by default)
    errors: list[tuple[str, Any]]  # (reason, seq or None), one per error reply to send

    def __len__(self) -> int: ...  # good messages

    def error_counts(self) -> list[tuple[str, int]]: ...  # (reason, bad elements) for the counters


class FrameDecoder(Protocol):
    """The IO thread's half of a codec (``controller.codec.Codec`` adds the main thread's)."""

    def decode(self, frame: str | bytes) -> DecodedFrame: ...

    def encode_error(self, reason: str, seq: Any) -> str | bytes | None: ...  # None: no error frame
