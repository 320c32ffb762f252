"""Typed run configuration: one TOML file describes a whole run, `--section.key=value` overrides it.

Every field carries its type (``Literal`` for choices) and optional bounds in its metadata, so a bad value
is rejected with a message that names the key, the value and what is allowed. `sections.py` holds the keys
every run shares; plug-ins (`liandan.plugins`) declare tables of their own (a model family's keys, an
optimizer's, an exporter's), which `loading.py` reads into the sections. Imports nothing else of liandan but
the plug-in registry.
"""

from liandan.config.fields import ConfigError, PluginTables, option, plugin_options, section_dict
from liandan.config.loading import (
    build_section,
    check_config,
    check_exporters_named,
    check_run_name,
    describe,
    from_dict,
    load_config,
    parse_override,
    read_toml,
)
from liandan.config.sections import (
    CheckpointSection,
    Config,
    DataSection,
    DoctorSection,
    EvalSection,
    ForecastSection,
    GuardSection,
    HealthSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    ResilienceSection,
    RunSection,
    ScheduleSection,
    TrackSection,
    TrainSection,
)

__all__ = [
    "CheckpointSection",
    "Config",
    "ConfigError",
    "DataSection",
    "DoctorSection",
    "EvalSection",
    "ForecastSection",
    "GuardSection",
    "HealthSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "PluginTables",
    "ResilienceSection",
    "RunSection",
    "ScheduleSection",
    "TrackSection",
    "TrainSection",
    "build_section",
    "check_config",
    "check_exporters_named",
    "check_run_name",
    "describe",
    "from_dict",
    "load_config",
    "option",
    "parse_override",
    "plugin_options",
    "read_toml",
    "section_dict",
]
