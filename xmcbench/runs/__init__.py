"""A run, floor by floor: plan (settings, the dataset read once) -> splits (training and validation rows) ->
component (a model built from registered components, trained) or whole (a whole method that fits itself) ->
the run folder (xmcbench.rundir). `launch.run` is the one entry point; nothing here is imported by the
package itself, so the commands that do not train start without torch."""
