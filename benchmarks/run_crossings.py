"""The module crossings of one run: which modules of xmcbench call which, from `xmcbench.train` to the finished run
folder: the distinct crossings, the pairs of modules that call each other (control going back up), the most
called-into module, and the circles of the package's import graph (imports inside functions included).

One tiny LightXML run (a 2-layer BERT built from a config, the tiny topic dataset, one epoch, 1 thread) under
sys.setprofile; every call whose caller and callee are in different xmcbench modules (plugins excluded: they are the
components, not the run's path; calls into a closure or lambda a caller passed down, such as a log function or a
file writer, excluded: they are callbacks, not dependencies) is one edge caller -> callee. Printed: the distinct edges, the distinct calls into the
most-called module ("returns to the hub"), and the edges themselves with --edges. Not timed: a count of the code's
structure, the same on any machine.

    python benchmarks/run_crossings.py
    python benchmarks/run_crossings.py --source /path/to/another/checkout   # its xmcbench package instead
"""

import argparse
import collections
import sys
import tempfile
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--source", help="a checkout whose xmcbench package is imported instead of the installed one")
parser.add_argument("--edges", action="store_true", help="print every edge and its number of calls")
args = parser.parse_args()
if args.source:
    sys.path.insert(0, args.source)

import xmcbench  # noqa: E402
from xmcbench.testing import make_tiny_transformer, write_tiny_dataset  # noqa: E402

CORE = "xmcbench"
# the run layer's own path: the training loop, the model and its tensors are the same code before and after
INSIDE_TRAINING = ("xmcbench.training", "xmcbench.model", "xmcbench.callbacks", "xmcbench.inference",
                   "xmcbench.batching", "xmcbench.optim", "xmcbench.checkpoint", "xmcbench.candidates",
                   "xmcbench.progress", "xmcbench.tokenization", "xmcbench.clustering", "xmcbench.workers")


def module_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == CORE or name.startswith(CORE + ".") else None


def import_circles(package: Path) -> list[list[str]]:
    """The strongly connected components (of 2 or more modules) of xmcbench's import graph, every import that runs
    counted, those inside functions too (not those under `if TYPE_CHECKING`)."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        targets = set()
        tree = ast.parse(path.read_text())
        for block in [node for node in ast.walk(tree) if isinstance(node, ast.If)
                      and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]:
            block.body = []   # imports for type annotations only: never run
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(CORE):
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.startswith(CORE))
        graph[name] = targets
    graph = {name: {t for t in targets if t in graph and t != name and t != CORE} for name, targets in graph.items()}
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):   # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main() -> None:
    print(f"xmcbench from {Path(xmcbench.__file__).parent}")
    edges: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee, caller_frame = module_of(frame), frame.f_back
        caller = module_of(caller_frame) if caller_frame is not None else None
        passed_down = "<locals>" in frame.f_code.co_qualname or frame.f_code.co_name == "<lambda>"
        if callee and caller and callee != caller and not passed_down \
                and not (callee in INSIDE_TRAINING and caller in INSIDE_TRAINING):
            edges[(caller, callee)] += 1

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        model = make_tiny_transformer(folder / "bert")
        data = write_tiny_dataset(folder / "tiny-topics")
        import os
        os.environ["XMCBENCH_CACHE"] = str(folder / "cache")
        sys.setprofile(profile)
        try:
            xmcbench.train("lightxml", str(data), output=folder / "run", log=None, model_name=str(model),
                           pretrained_weights=False, num_layers=2, epochs=1, max_length=16, threads=1, hidden_size=8,
                           validation_size=8, batch_size=8)
        finally:
            sys.setprofile(None)
    into = collections.Counter(callee for _, callee in edges)
    hub, hub_edges = into.most_common(1)[0]
    mutual = sorted({tuple(sorted(edge)) for edge in edges if (edge[1], edge[0]) in edges})
    print(f"distinct module crossings (caller -> callee): {len(edges)}")
    print(f"modules on the path: {len({module for edge in edges for module in edge})}")
    print(f"the most called-into module: {hub}, from {hub_edges} other modules")
    print(f"pairs of modules calling each other: {len(mutual)}" + "".join(f"\n  {a} <-> {b}" for a, b in mutual))
    circles = import_circles(Path(xmcbench.__file__).parent)
    print(f"circles in the import graph: {len(circles)}" + "".join(f"\n  {' -> '.join(c)}" for c in circles))
    if args.edges:
        for (caller, callee), calls in sorted(edges.items()):
            print(f"  {caller} -> {callee}  ({calls} calls)")


main()
