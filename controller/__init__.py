"""The main-thread side: configuration, codec, batching, processors, statistics, the loop."""

from controller.batching import Batch
from controller.codec import Codec, Decoded, JsonCodec
from controller.config import Config, ConfigError
from controller.loop import Controller, compilations
from controller.processor import EWMAState, Processor, default_processor, ewma_processor
from controller.stats import StatsSnapshot

__all__ = [
    "Batch", "Codec", "Config", "ConfigError", "Controller", "Decoded", "EWMAState", "JsonCodec",
    "Processor", "StatsSnapshot", "compilations", "default_processor", "ewma_processor",
]
