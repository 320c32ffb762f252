"""The pipeline: the stage protocol (stages.py), every file of its output (layout.py), its config
(pipeline_config.py), the stages and the run (pipeline.py), executors (executor.py: local processes, Ray),
publishing (publish.py) and a run's own data through the same stages (prepare.py). The top room of data."""
