"""``python tests/no_inet.py PROGRAM ARGS…``: run PROGRAM (``app.py``) as ``__main__`` in a process
that refuses every IPv4 and IPv6 socket, TCP and UDP alike, as the TPU host the project is lent
does (only unix-domain sockets pass there).

Rules:
- Installed before anything else is imported: ``socket.socket`` is replaced by a subclass whose
  constructor raises ``PermissionError`` (EPERM, the TPU host's answer) for ``AF_INET`` and
  ``AF_INET6`` (and the default family, which is ``AF_INET``); a socket made from a file
  descriptor is left alone. asyncio, aiohttp and the standard library make their sockets
  through ``socket.socket``, so any of them that tries is refused.
- Each refusal is also written to stderr as one line starting ``no_inet: refused`` with the
  caller's stack, so a test can fail on it even where the program caught the error and went on.
"""

from __future__ import annotations

import errno
import runpy
import socket
import sys
import traceback

REFUSED = "no_inet: refused"
_Socket = socket.socket


class _UnixOnlySocket(_Socket):
    """``socket.socket`` that refuses the IPv4 and IPv6 families (see the module rules)."""

    def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            shown = {socket.AF_INET6: "AF_INET6"}.get(family, "AF_INET")
            sys.stderr.write(f"{REFUSED} socket({shown}, type {type})\n{''.join(traceback.format_stack())}")
            sys.stderr.flush()
            raise PermissionError(errno.EPERM, f"{shown} sockets are refused on this host (tests/no_inet.py)")
        super().__init__(family, type, proto, fileno)


def main() -> None:
    socket.socket = _UnixOnlySocket  # type: ignore[misc]
    program = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(__import__("pathlib").Path(program).resolve().parent)
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
