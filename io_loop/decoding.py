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
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["DecodedFrame", "FrameDecoder"]


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
