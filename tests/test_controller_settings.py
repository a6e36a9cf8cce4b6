"""The controller side's settings groups (controller/settings/groups.py): built from ``Config`` in one place,
each handed only to the component that reads it, never the whole ``Config`` (issue 47, item 4)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from forkless.controller.config import Config

ROOT = Path(__file__).resolve().parents[1]

# the components handed a group instead of the whole configuration
COMPONENTS = ("controller/checkpoints/checkpointer.py", "controller/checkpoints/recovery.py")
# what only the composition roots (the loop, the commands) call on a ``Config``: a component is handed the result
BUILDERS = {"io_settings", "checkpoint_settings", "relay_settings"}


def _takes_the_whole_config(path: Path) -> list[str]:
    """Where ``path`` imports ``Config``, names a parameter ``config``/``cfg``, or builds a group itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "Config" for alias in node.names):
            found.append(f"line {node.lineno}: imports Config")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if arg.arg in ("config", "cfg"):
                    found.append(f"line {node.lineno}: {node.name}() takes {arg.arg!r}")
        elif isinstance(node, ast.Attribute) and node.attr in BUILDERS:
            found.append(f"line {node.lineno}: calls .{node.attr}()")
    return found


def test_the_checkpoint_components_take_their_groups_never_the_whole_config():
    taking = {path: found for path in COMPONENTS if (found := _takes_the_whole_config(ROOT / path))}
    assert not taking, taking


def test_the_components_arguments_are_typed_as_their_groups():
    from forkless.controller.checkpoints.checkpointer import checkpoints_for, store_for
    from forkless.controller.checkpoints.recovery import Recovery

    for function, name, group in ((store_for, "checkpoints", "CheckpointSettings"),
                                  (checkpoints_for, "checkpoints", "CheckpointSettings"),
                                  (Recovery, "checkpoints", "CheckpointSettings"),
                                  (Recovery, "shape", "StateShape")):
        assert str(inspect.signature(function).parameters[name].annotation) == group, (function, name)


def test_each_group_carries_the_configuration_s_values_each_field_naming_its_config_field():
    from forkless.controller.settings.groups import CheckpointSettings
    from forkless.io_loop.settings import config_field

    cfg = Config(checkpoint_dir="/tmp/ckpt", checkpoint_s=7.5, checkpoint_keep=5, checkpoint_restore="never",
                 checkpoint_priority="normal")
    checkpoints = cfg.checkpoint_settings()
    assert type(checkpoints) is CheckpointSettings and checkpoints.on and cfg.checkpoints_on
    assert (checkpoints.dir, checkpoints.every_s, checkpoints.keep, checkpoints.restore, checkpoints.priority,
            checkpoints.bucket) == ("/tmp/ckpt", 7.5, 5, "never", "normal", "")
    assert not Config().checkpoint_settings().on
    for group in (checkpoints,):
        for f in dataclasses.fields(group):
            assert getattr(group, f.name) == getattr(cfg, config_field(f)), (type(group).__name__, f.name)
        assert type(group).__dataclass_params__.frozen  # every thread may read them
