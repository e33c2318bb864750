"""xmcbench's built-in training loggers, one module per logger: TensorBoard and MLflow (`--set
loggers=tensorboard,mlflow`). Each is an `xmcbench.callbacks.TrainingCallback` built by a factory
`build(run_dir, config)` and registered through the `xmcbench_register_loggers` hook (`plugin.py`). The run
directory's own `training_log.json` is not a plugin: every run writes it (`xmcbench.callbacks.JsonLog`)."""
