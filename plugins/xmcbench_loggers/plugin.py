"""Entry point of the built-in training loggers: registers one logger per module of this package."""

from xmcbench.hookspecs import hookimpl
from xmcbench_loggers import mlflow_log, tensorboard


@hookimpl
def xmcbench_register_loggers(registry):
    for module in (tensorboard, mlflow_log):
        registry.add_logger(module.NAME, module.build, module.DESCRIPTION, extra=module.EXTRA)
