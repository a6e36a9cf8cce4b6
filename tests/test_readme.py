"""The README is the front door: its commands, variables and code examples must stay true."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from controller.config import VARIABLES, Config, _as_text
from tests.feed import FeedServer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", README, re.S)
    assert match, f"README example {name!r} not found"
    return match.group(1)


def run_example(name: str, url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update({"JAX_PLATFORMS": "cpu", "FORKLESS_WS_URL": url, "FORKLESS_RECONNECT_MIN_S": "0.1"})
    return subprocess.run([sys.executable, "-c", example(name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=90)


def test_the_test_command_in_the_readme_is_what_ci_runs():
    command = ("python -m venv .venv && . .venv/bin/activate && python -m pip install -r requirements-dev.txt"
               " && JAX_PLATFORMS=cpu python -m pytest -q")
    assert f"```\n{command}\n```" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci


def test_the_variables_table_lists_every_variable_with_its_real_default():
    table = README.split("<!-- variables:start -->")[1].split("<!-- variables:end -->")[0]
    defaults = Config()
    for var in VARIABLES:
        default = getattr(defaults, var.field)
        shown = "(unset)" if default in (None, "", ()) else f"`{_as_text(default)}`"
        assert f"| `{var.env}` | {shown} | {var.allowed} | {var.help} |" in table, var.env
    assert table.count("| `FORKLESS_") == len(VARIABLES)


def test_the_blocking_embedding_example_runs_with_its_own_processor_and_codec():
    frames = ["a,0,3,4", "b,1,1,0", "a,2,0,2", "a,3,bad"]
    with FeedServer(frames, gap_s=0.2) as server:  # paced: one message per batch
        proc = run_example("blocking", server.url)
        replies = server.wait_replies(4, timeout=5, raw=True)
    assert proc.returncode == 0, proc.stderr
    assert replies == ["0,a,1,5.000", "1,b,1,1.000", "2,a,2,2.000", "error,None,need 2 values"]


def test_the_driven_embedding_example_runs_the_default_detector():
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i % 3)] * 8}) for i in range(50)]
    with FeedServer(frames) as server:
        proc = run_example("driven", server.url)
    assert proc.returncode == 0, proc.stderr
    assert "50 results sent, 0 anomalies, 0 errors" in proc.stdout
    assert len(server.replies) == 50
