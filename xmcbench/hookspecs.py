"""Every hook a plugin can implement. A plugin is a module listed under the `xmcbench` entry-point group.

Each hook receives the registry and calls its `add_*` methods; the registry checks types and names and
rejects a name another plugin registered first, naming both plugins (only that name: the rest of the plugin
loads). Implement a hook with `@xmcbench.hookspecs.hookimpl`; a plugin's hooks run in the order below
(components first, so its methods may name them).

A plugin that fails (its import raises, a hook raises, it registers a wrong type or a bad name, or it
implements a hook not declared here, e.g. a misspelled one) is not loaded at all: what it had registered is
removed, and `xmcbench plugins` shows it with its package and a one-line error (with the file and line for
a hook that raised). Every hook here must keep a
docstring and a section in CONTRIBUTING.md (`tests/test_plugin_loading.py` checks both).
"""

import pluggy

PROJECT_NAME = "xmcbench"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def xmcbench_register_components(registry):
    """Register encoders, recallers, rankers and samplers.

    Call `registry.add_component(kind, name, factory)` where kind is one of "encoder", "recaller",
    "ranker", "sampler" and `factory` builds an `xmcbench.interfaces` object of that kind. The pipeline
    calls factories as `factory(config, **exported)` (encoder; `exported` is what `Encoder.export`
    returned, empty for a new model), `factory(config, in_dim, num_clusters)` (recaller),
    `factory(config, in_dim, num_labels)` (ranker) and `factory(config)` (sampler), where `config` is the
    run's `xmcbench.config.TrainConfig`, plus the keyword-only parameters a factory declares of `label_info`
    (the run's `xmcbench.interfaces.LabelInfo`) and `encoder` (the method's encoder, shared; not for encoders).
    A recaller that is an `xmcbench.interfaces.Retriever` is registered with `retriever=True`.
    `xmcbench.testing.check_component` checks a factory against this contract, `check_method` a method's
    composed model.
    """


@hookspec
def xmcbench_register_methods(registry):
    """Register methods: named recipes of one component per kind plus default hyperparameters.

    Call `registry.add_method(MethodSpec(...))`; see `xmcbench.config.MethodSpec` (component names and
    settings in `defaults`, per-dataset `presets`, optional training `stages`). A method not built from
    components (a linear XMC method) names its `xmcbench.interfaces.WholeMethod` subclass in
    `MethodSpec(..., whole_method=TheClass)` instead; `xmcbench.testing.check_whole_method` checks it.
    """


@hookspec
def xmcbench_register_datasets(registry):
    """Register datasets a user can name with `--dataset`.

    Call `registry.add_dataset(DatasetSpec(...))`; see `xmcbench.data.DatasetSpec` and, for the files, the
    card, the checksum and the licence, `datasets/README.md`.
    """


@hookspec
def xmcbench_register_formats(registry):
    """Register data formats: layouts of a folder or file that `--dataset PATH` reads and `xmcbench convert` writes.

    Call `registry.add_format(DataFormat(...))`; see `xmcbench.formats.DataFormat` (a name for `--format`, a
    `detect(path)` that recognises the layout, `read(path, options)` returning an `xmcbench.data.Dataset`,
    an optional `write(dataset, folder, options)`) and `xmcbench.formats.FormatOptions` for the options.
    """


@hookspec
def xmcbench_register_loggers(registry):
    """Register training loggers: callbacks a user enables with `--set loggers=NAME,...` (TensorBoard, MLflow).

    Call `registry.add_logger(name, factory, description, extra=None)`. `factory(run_dir, config)` receives
    the run directory (it exists; write under it) and the run's `xmcbench.config.TrainConfig`, and returns an
    `xmcbench.callbacks.TrainingCallback` whose events (on_train_begin, on_log(records), on_evaluate(record),
    ..., on_train_end) the trainer calls; see xmcbench/callbacks.py for the events, their order and what a
    logger may read. A logger only reads: it must not change the model, the data order or any random state.
    Import the logger's library inside the factory and raise `xmcbench.errors.XmcError` in one line naming
    `pip install 'xmcbench[EXTRA]'` when it is missing; `extra` names that pip extra for `xmcbench plugins`
    (None: no extra needed). `xmcbench.testing.check_logger` checks a factory against this contract.
    """


@hookspec
def xmcbench_register_executors(registry):
    """Register grid executors: engines a user picks with `xmcbench compare --executor NAME` to run the cells of
    a grid (local processes, Ray, Slurm).

    Call `registry.add_executor(name, factory, description, extra=None)`. `factory(options)` receives an
    `xmcbench.executors.ExecutorOptions` (`--cell-cpus`, `--cell-gpus`, `--address`, `--partition`,
    `--time-limit`, `--executor-option key=value`, and a shared folder for the engine's files) and returns an
    `xmcbench.executors.Executor`: `submit(task)` starts a cell whose work is `xmcbench.executors.run_cell(task)`
    wherever it runs (the task holds paths and settings, never the data), `wait(timeout)` returns the
    `CellResult`s of cells that ended, `cancel()` interrupts the rest, `close()` releases the engine. Check
    options and import the engine inside the factory, raising `xmcbench.errors.XmcError` in one line (naming
    `pip install 'xmcbench[EXTRA]'` when the engine is missing); `extra` names that pip extra for `xmcbench
    plugins`. `xmcbench.testing.check_executor` checks a factory against this contract.
    """


@hookspec
def xmcbench_register_metrics(registry):
    """Register metric families: what `xmcbench.metrics.evaluate` computes from a ranking, e.g. P (P@1, P@3, ...).

    Call `registry.add_metric_family(MetricFamily(...))`; see `xmcbench.metrics.MetricFamily`: a name (its keys
    are NAME@K), a one-line description, whether it is computed at each cut-off k, whether higher is better,
    whether it needs propensities, whether it may select the epoch (`selection_metric`), and
    `compute(ranking)`, which returns {key: value} from an `xmcbench.metrics.Ranking` (the top predictions, their
    hits, the truth, the cut-offs, the inverse propensities, and the sums the built-in families share).
    """


@hookspec
def xmcbench_register_indexers(registry):
    """Register label indexers: what groups a run's labels into its clusters, picked with `--set indexer=NAME`.

    Call `registry.add_indexer(name, index, description)`. `index(label_features, num_clusters, seed, threads)`
    receives the (L, F) float32 CSR label features with L2-normalised rows (PIFA: a label's documents' features
    summed, `xmcbench.features.label_features`), the number of clusters K (a power of two below L), the run's
    seed and its thread count (0: one per core), and returns the (L,) int64 cluster of each label: every cluster
    holds floor(L/K) or ceil(L/K) labels, and cluster ids follow a binary tree (clusters c and c' are in one
    node of n when c // (K // n) == c' // (K // n)), which the deeper tree levels read. See `xmcbench.indexing`.
    """
