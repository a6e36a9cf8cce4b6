"""CI's free-threaded step (.ci/free-threaded): where no free-threaded interpreter can be found or built, it
says why in one line and passes; CI never fails for want of the interpreter. (Where one is found, the step
installs and runs ``pytest -m threads``: minutes, run by CI itself, not here.)"""

from __future__ import annotations

import os
import socket
import subprocess

from tests.harness import ROOT, UNIT_S


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_with_no_interpreter_and_no_way_to_build_one_the_step_says_why_in_one_line_and_passes(tmp_path):
    proxy = f"http://127.0.0.1:{_closed_port()}"  # the source's download refused at once: the build fails
    env = {k: v for k, v in os.environ.items() if k not in ("FORKLESS_FT_PYTHON", "FORKLESS_FT_PREFIX")}
    env.update(PATH="/usr/bin:/bin", HOME=str(tmp_path), FORKLESS_FT_PREFIX=str(tmp_path / "prefix"),
               http_proxy=proxy, HTTP_PROXY=proxy)
    done = subprocess.run(["bash", str(ROOT / ".ci" / "free-threaded")], env=env, capture_output=True, text=True,
                          timeout=120 * UNIT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("free-threaded tests skipped: no free-threaded CPython"), lines
    assert "curl" in lines[0]  # the reason the build gave
