"""The README is the front door: its commands, variables and code examples must stay true."""

from __future__ import annotations

import json
import re

from controller.config import VARIABLES, Config, _as_text
from tests.harness import ROOT, UNIT_S, AppResult, run_app
from tests.servers import send_frames

README = (ROOT / "README.md").read_text()


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", README, re.S)
    assert match, f"README example {name!r} not found"
    return match.group(1)


def run_example(name: str, url: str) -> AppResult:
    return run_app(env={"FORKLESS_WS_URL": url, "FORKLESS_RECONNECT_MIN_S": "0.1"},
                   program=("-c", example(name)), timeout_s=90 * UNIT_S)


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


def test_the_blocking_embedding_example_runs_with_its_own_processor_and_codec(feed_server):
    frames = ["a,0,3,4", "b,1,1,0", "a,2,0,2", "a,3,bad"]
    server = feed_server(send_frames(frames, gap_s=0.2))  # paced: one message per batch
    proc = run_example("blocking", server.url)
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    assert server.received == ["0,a,1,5.000", "1,b,1,1.000", "2,a,2,2.000", "error,None,need 2 values"]


def test_the_driven_embedding_example_runs_the_default_detector(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i % 3)] * 8}) for i in range(50)]
    server = feed_server(send_frames(frames))
    proc = run_example("driven", server.url)
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    assert "50 results sent, 0 anomalies, 0 errors" in proc.stdout
    assert len(server.replies()) == 50
