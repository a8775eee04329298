"""Job configuration: a YAML file validated by pydantic on load.

Unknown keys are errors and every message names the field. Credentials are not part of the
configuration: they come from the environment or the cloud identity (see storage.py).
"""

from pipeline.config.base import ConfigError, Section, closest
from pipeline.config.input_rows import InputRowsConfig, TemplateMessage
from pipeline.config.job import JobConfig
from pipeline.config.messages import config_error_lines, unknown_key_message
from pipeline.config.load import load_config, parse_config
from pipeline.config.paths import PATH_FIELDS, output_inside_input
from pipeline.config.resources import LeaseConfig, ReplicaRange, ResourcesConfig, RetriesConfig
from pipeline.config.rows import (
    JOB_ONLY_SAMPLING,
    MAX_LOGPROBS,
    MAX_SAMPLES,
    ChatConfig,
    JsonSchemaFormat,
    LoraConfig,
    ResponseFormat,
    SamplingConfig,
    speculation_conflicts,
)
from pipeline.config.sections import (
    ACCEPTANCE_FLOOR,
    EngineConfig,
    GuardConfig,
    ModelConfig,
    ProbeConfig,
    SpeculativeConfig,
    StorageConfig,
    validate_check_names,
)

__all__ = [
    "ACCEPTANCE_FLOOR",
    "JOB_ONLY_SAMPLING",
    "MAX_LOGPROBS",
    "MAX_SAMPLES",
    "PATH_FIELDS",
    "ChatConfig",
    "ConfigError",
    "EngineConfig",
    "GuardConfig",
    "InputRowsConfig",
    "JobConfig",
    "JsonSchemaFormat",
    "LeaseConfig",
    "LoraConfig",
    "ModelConfig",
    "ProbeConfig",
    "ReplicaRange",
    "ResourcesConfig",
    "ResponseFormat",
    "RetriesConfig",
    "SamplingConfig",
    "Section",
    "SpeculativeConfig",
    "StorageConfig",
    "TemplateMessage",
    "closest",
    "config_error_lines",
    "load_config",
    "output_inside_input",
    "parse_config",
    "speculation_conflicts",
    "unknown_key_message",
    "validate_check_names",
]
