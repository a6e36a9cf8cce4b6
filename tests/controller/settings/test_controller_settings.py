"""The controller side's settings groups (controller/settings/groups.py): a ``Config``'s own, each handed only to the
component that reads it, never the whole ``Config`` (issue 47, item 4)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from forkless.controller.config import Config

ROOT = Path(__file__).resolve().parents[3]

# the components handed a group instead of the whole configuration
COMPONENTS = ("controller/checkpoints/checkpointer.py", "controller/recovery.py",
              "controller/partitions/partitioned.py", "controller/eventsonly.py")
# the device side: compiling and running the step reads the step's settings (``StepSettings``, or anything
# with its fields: the ``StepShape`` protocol), never the whole configuration
DEVICE_SIDE = ("controller/engine.py",
               *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "controller/device").glob("*.py")))
# what only the composition roots (the loop, the commands) call on a ``Config``: a component is handed the result
BUILDERS = {"io_settings", "instance_settings", "relay_settings"}


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


def test_the_checkpoint_and_partition_components_take_their_groups_never_the_whole_config():
    taking = {path: found for path in COMPONENTS if (found := _takes_the_whole_config(ROOT / path))}
    assert not taking, taking


def test_the_device_side_takes_the_step_settings_never_the_whole_config():
    assert len(DEVICE_SIDE) > 3, DEVICE_SIDE  # the glob found the device modules
    taking = {path: found for path in DEVICE_SIDE if (found := _takes_the_whole_config(ROOT / path))}
    assert not taking, taking


def test_the_components_arguments_are_typed_as_their_groups():
    from forkless.controller.checkpoints.checkpointer import checkpoints_for, store_for
    from forkless.controller.device.compiled import check_row_writes
    from forkless.controller.device.layouts import OneDevice, Sharded
    from forkless.controller.device.programs import program_key
    from forkless.controller.engine import Engine, compile_step
    from forkless.controller.eventsonly import check_events_only
    from forkless.controller.partitions.partitioned import PartitionOwner
    from forkless.controller.recovery import Recovery

    for function, name, group in ((store_for, "checkpoints", "CheckpointSettings"),
                                  (checkpoints_for, "checkpoints", "CheckpointSettings"),
                                  (Recovery, "checkpoints", "CheckpointSettings"),
                                  (Recovery, "shape", "StateShape"),
                                  (PartitionOwner.open, "settings", "InstanceSettings"),
                                  (check_events_only, "checkpoints", "CheckpointSettings"),
                                  (compile_step, "settings", "StepShape"),
                                  (Engine, "settings", "StepSettings"),
                                  (OneDevice, "settings", "StepShape"),
                                  (Sharded, "settings", "StepShape"),
                                  (program_key, "settings", "StepShape"),
                                  (check_row_writes, "settings", "StepShape")):
        assert str(inspect.signature(function).parameters[name].annotation) == group, (function, name)


def test_each_group_carries_the_configuration_s_values_each_field_read_back_by_its_keyword():
    from forkless.controller.settings.groups import CheckpointSettings, InstanceSettings, StepSettings
    from forkless.io_loop.settings import settings_of

    cfg = Config(checkpoint_dir="/tmp/ckpt", checkpoint_s=7.5, checkpoint_keep=5, checkpoint_restore="never",
                 checkpoint_priority="normal", max_streams=64, lease_s=2.5, lease_bucket="leases", tls_insecure=True)
    checkpoints = cfg.checkpoints
    assert type(checkpoints) is CheckpointSettings and checkpoints.on and cfg.checkpoints_on
    assert (checkpoints.dir, checkpoints.every_s, checkpoints.keep, checkpoints.restore, checkpoints.priority) == (
        "/tmp/ckpt", 7.5, 5, "never", "normal")
    assert not Config().checkpoints.on
    assert (Config().feed_variable, Config(ws_url="ws://127.0.0.1:9/").feed_variable) == ("", "FORKLESS_WS_URL")
    assert Config(feeds='[{"url": "ws://127.0.0.1:9/a"}]').feed_variable == "FORKLESS_FEEDS"
    instance = cfg.instance_settings()
    assert type(instance) is InstanceSettings
    io = cfg.io_settings()  # the store connects as the IO side's connections do, with their groups
    assert (instance.partitioning, instance.timeouts, instance.reconnect, instance.tls) == (
        io.partitioning, io.timeouts, io.reconnect, io.tls)
    assert (instance.partitioning.lease_s, instance.partitioning.lease_bucket, instance.tls.insecure) == (
        2.5, "leases", True)
    assert (instance.keep, instance.max_streams, instance.instance, instance.instances) == (5, 64, None, None)
    stepping = Config(features=3, max_streams=64, max_batch=100, devices=1, steps_in_flight=2)
    step = stepping.step
    assert type(step) is StepSettings
    assert (step.features, step.max_streams, step.max_batch, step.devices, step.steps_in_flight, step.buckets) == (
        3, 64, 100, 1, 2, (1, 4, 16, 64, 100))
    assert Config(max_batch=100).buckets == step.buckets and Config(max_batch=1).buckets == (1,)
    for group, of in ((checkpoints, cfg), (step, stepping)):
        for declared in settings_of(type(group)):
            assert getattr(group, declared.field) == getattr(of, declared.keyword), declared.env
        assert type(group).__dataclass_params__.frozen  # every thread may read them
    assert type(instance).__dataclass_params__.frozen


def test_a_partitioned_instance_s_settings_say_which_it_is_and_where_its_leases_and_objects_go():
    import json

    feed = {"name": "ticks", "nats": "nats://127.0.0.1:4222", "stream": "TICKS", "subject": "ticks.{partition}.>",
            "results": "scores", "partition_count": 12}
    cfg = Config.from_env({"FORKLESS_FEEDS": json.dumps([feed]), "FORKLESS_INSTANCE": "1", "FORKLESS_INSTANCES": "3",
                           "FORKLESS_CHECKPOINT_BUCKET": "ckpt", "FORKLESS_LEASE_S": "4"})
    instance = cfg.instance_settings()
    assert (instance.instance, instance.instances) == (1, 3)
    assert (instance.partitioning.checkpoint_bucket, instance.partitioning.lease_s) == ("ckpt", 4.0)
    assert cfg.checkpoints_on and not cfg.checkpoints.on and cfg.checkpoints.dir == ""  # in the bucket, no directory


def test_a_config_and_its_step_settings_both_are_a_step_shape_and_compile_the_same_step():
    from forkless.controller.engine import compile_step
    from forkless.controller.processor import default_processor
    from forkless.controller.settings.groups import StepSettings, StepShape

    cfg = Config(features=2, max_streams=8, max_batch=5, devices=1, steps_in_flight=2)
    step = cfg.step
    wanted = [name for name in dir(StepShape) if isinstance(getattr(StepShape, name), property)]
    assert sorted(wanted) == ["buckets", "devices", "features", "max_batch", "max_streams", "steps_in_flight"]
    for name in wanted:  # what the device side reads, the same on both
        assert getattr(step, name) == getattr(cfg, name), name
    from_settings, from_config = compile_step(default_processor(cfg), step), compile_step(default_processor(cfg), cfg)
    assert set(from_settings.steps) == set(from_config.steps) == {1, 4, 5}
    assert from_settings.settings == from_config.settings == StepSettings.on_platform(step, "cpu")
    assert from_settings.settings.steps_in_flight == 2


def test_steps_in_flight_is_resolved_once_at_the_compile_into_the_settings_the_engine_and_the_loop_read():
    from forkless.controller.engine import compile_step
    from forkless.controller.processor import default_processor
    from forkless.controller.settings.groups import StepSettings

    auto = Config(features=2, max_streams=8, max_batch=4, devices=1)  # FORKLESS_STEPS_IN_FLIGHT=auto
    assert auto.step.steps_in_flight == "auto"  # as configured: where it runs is not known yet
    assert [StepSettings.on_platform(auto, platform).steps_in_flight for platform in ("cpu", "tpu", "gpu")] == [
        1, 2, 2]
    assert StepSettings.on_platform(auto.replace(steps_in_flight=3), "cpu").steps_in_flight == 3
    engine = compile_step(default_processor(auto), auto.step)
    assert engine.settings == StepSettings(features=2, max_streams=8, max_batch=4, devices=1, steps_in_flight=1)
    assert not engine.resets_in_step  # one step at a time: the loop resets a non-finite stream's rows
