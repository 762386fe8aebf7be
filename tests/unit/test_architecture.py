"""The package's layering (docs/architecture.md): imports run one way, from the command lines
down to the core, with no cycle, and the core never imports Megatron, DeepSpeed or transformers.

Every import statement counts, including those inside functions (a lazy import is still a
dependency)."""

import ast
import os

import pytest

from tests.helpers.paths import PACKAGE


# Each top-level part of the package and its layer: a module may import from its own layer and below.
LAYERS = {
    # the core (suggest: the closest known name, for error messages)
    "fe_megatron": 0, "config": 0, "presets": 0, "suggest": 0, "hybrid_pattern": 0, "ngram": 0, "ops": 0, "tables": 0, "memory": 0,
    "data": 1,
    "training": 2,
    "checkpoint": 3,
    "megatron": 4, "deepspeed": 4, "hf": 4, "vllm": 4,  # adapters and their engines (vllm serves over hf)
    "convert": 5, "evaluation": 5, "planning": 5,
    "megatron_lm": 5,  # Megatron-LM's own trainer over the Megatron adapter (megatron-core 0.19 on)
    "train": 6, "demo": 6,  # command lines (and every */cli.py, below)
}
COMMAND_LINES = {"fe_megatron.data.cli", "fe_megatron.evaluation.cli", "fe_megatron.evaluation.inspect",
                 "fe_megatron.convert.cli", "fe_megatron.convert.__main__", "fe_megatron.planning.cli",
                 "fe_megatron.vllm.cli"}
CORE = {name for name, layer in LAYERS.items() if layer == 0}
# Inside the core, imports run one way too: the tables (where rows live, how they move and learn) sit
# below the memory branches (the equations), which read rows through them.
CORE_ORDER = {"suggest": 0, "hybrid_pattern": 0, "config": 0, "presets": 0, "ngram": 1, "ops": 1, "tables": 2, "memory": 3, "fe_megatron": 4}
FORBIDDEN_IN_CORE = ("megatron", "deepspeed", "transformers")


def modules() -> dict:
    """``{dotted module name: path}`` of every module in the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def imports_of(name: str, path: str, known: dict) -> tuple:
    """``(package modules, third-party top-level names)`` that module ``name`` imports."""
    is_package = path.endswith("__init__.py")
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "fe_megatron":
                while target not in known:
                    target = target.rsplit(".", 1)[0]
                inside.add(target)
            else:
                outside.add(target.split(".")[0])
    inside.discard(name)
    return inside, outside


def layer_of(name: str) -> int:
    if name in COMMAND_LINES:
        return max(LAYERS.values())
    parts = name.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else parts[0]]


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return known, {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_part_of_the_package_has_a_layer(graph):
    known, _ = graph
    unplaced = sorted({name.split(".")[1] for name in known if "." in name} - set(LAYERS))
    assert not unplaced, f"add these to LAYERS (and docs/architecture.md): {unplaced}"


def test_no_module_imports_from_a_layer_above_it(graph):
    _, edges = graph
    upward = [f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
              for name, (inside, _) in sorted(edges.items()) for target in sorted(inside)
              if layer_of(target) > layer_of(name)]
    assert not upward, "\n".join(upward)


def test_the_core_imports_no_framework(graph):
    _, edges = graph
    bad = [f"{name} imports {lib}" for name, (_, outside) in sorted(edges.items())
           if layer_of(name) == 0 for lib in sorted(outside) if lib in FORBIDDEN_IN_CORE]
    assert not bad, "\n".join(bad)


MEGATRON_GRADIENT_PROTOCOL = ("grad_added_to_main_grad", "zero_out_wgrad")


def names_in_code(path: str) -> dict:
    """``{name: first line}`` of every name module ``path``'s code uses: variables, attributes, imported
    names, and string constants that are a name (``getattr(param, "main_grad")``); comments and prose are
    not code."""
    found = {}
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name.rsplit(".", 1)[-1] for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names = [node.value]
        else:
            continue
        for name in names:
            found.setdefault(name, node.lineno)
    return found


def uses_of(names, modules_paths) -> list:
    """``module:line uses NAME`` for each of ``names`` that the code of each ``(module, path)`` uses."""
    return [f"{module}:{used[name]} uses {name}" for module, path in modules_paths
            for used in (names_in_code(path),) for name in names if name in used]


def test_the_core_does_not_implement_megatron_s_gradient_protocol():
    """Megatron's DDP flags are the Megatron adapter's (fe_megatron/megatron/main_grad.py, registered with
    the kernels' dispatch); an import test cannot see a protocol spoken through attribute names."""
    found = uses_of(MEGATRON_GRADIENT_PROTOCOL, [(name, path) for name, path in sorted(modules().items())
                                                 if layer_of(name) == 0])
    assert not found, "\n".join(found)


def test_the_name_checks_read_code_not_comments(tmp_path):
    """`uses_of`, behind the protocol and holder checks, finds a name in code (as a variable, an attribute, an
    import or getattr's string) and not in a comment or a docstring."""
    module = tmp_path / "module.py"
    module.write_text('"""Mentions EngineParameter and is_meta in prose."""\n# zero_out_wgrad in a comment\n'
                      "from fe_megatron.tables.holders import EngineParameter\n"
                      "def f(p):\n    return p.is_meta or getattr(p, 'grad_added_to_main_grad')\n")
    names = ("EngineParameter", "is_meta", "grad_added_to_main_grad", "zero_out_wgrad")
    assert uses_of(names, [("module", str(module))]) == [
        "module:3 uses EngineParameter", "module:5 uses is_meta", "module:5 uses grad_added_to_main_grad"]


# Who holds a table's rows (docs/architecture.md, "Who decides how the tables are kept"): the module that
# picks the holder names it, and nothing else asks which kind it is.
HOLDER_KINDS = ("EngineParameter", "ReadOnlyRows", "is_meta")
PICKS_THE_HOLDER = {"fe_megatron.tables.holders", "fe_megatron.memory.tables"}


def test_no_module_asks_which_kind_of_holder_keeps_a_table():
    """A table's rows are read, drawn, handed to a store and saved through its holder's interface
    (fe_megatron/tables/holders.py); a module that tested for a kind (or for an unset placeholder) would
    branch on what kind of object a weight is."""
    found = uses_of(HOLDER_KINDS, [(name, path) for name, path in sorted(modules().items())
                                   if name not in PICKS_THE_HOLDER])
    assert not found, "\n".join(found)


# Where a table's rows are (docs/architecture.md, "Who decides how the tables are kept"): the tables package
# keeps them, and `NgramTables` (fe_megatron/memory/tables.py) hands them to their holder. Every other module
# reaches rows through the holder's interface (`start_lookup`, `exchange_group`, ...) or the owner of a stage's
# tables (`StageTables.stores`), never through a store: no `<anything>.store` attribute, and no import of what
# reads a store directly.
OWNS_THE_STORES = ("fe_megatron.tables", "fe_megatron.memory.tables")
READS_A_STORE = {"TableStore", "StoreLookup", "row_lookup", "StageRowExchange", "RowShardedRows"}


def reaches_past_the_holder(name: str, path: str) -> list:
    """Where module ``name`` reads a table's store itself: ``.store`` attributes, and imports of what reads one."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        triton_store = isinstance(getattr(node, "value", None), ast.Name) and node.value.id == "tl"  # tl.store
        if isinstance(node, ast.Attribute) and node.attr == "store" and not triton_store:
            found.append(f"{name}:{node.lineno} reads .store")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fe_megatron"):
            found += [f"{name}:{node.lineno} imports {alias.name}" for alias in node.names
                      if alias.name in READS_A_STORE]
    return found


def test_no_module_reaches_a_table_store_past_its_holder():
    found = [line for name, path in sorted(modules().items())
             if not any(name == owner or name.startswith(owner + ".") for owner in OWNS_THE_STORES)
             for line in reaches_past_the_holder(name, path)]
    assert not found, "\n".join(found)


def test_the_holder_check_sees_a_store_read_and_an_import(tmp_path):
    """The check above would catch what it is for (and not only three strings)."""
    module = tmp_path / "reader.py"
    module.write_text("from fe_megatron.tables.row_exchange import row_lookup\n"
                      "def rows(branch, ids):\n    return row_lookup(branch.tables.store, ids)\n")
    assert reaches_past_the_holder("reader", str(module)) == ["reader:1 imports row_lookup", "reader:3 reads .store"]


def test_inside_the_core_the_tables_sit_below_the_memory_branches(graph):
    _, edges = graph

    def rank(name):
        parts = name.split(".")
        return CORE_ORDER[parts[1] if len(parts) > 1 else parts[0]]

    upward = [f"{name} imports {target}" for name, (inside, _) in sorted(edges.items()) if layer_of(name) == 0
              for target in sorted(inside) if rank(target) > rank(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle(graph):
    _, edges = graph
    cycles = find_cycles({name: inside for name, (inside, _) in edges.items()})
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def find_cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


ARCHITECTURE = os.path.join(os.path.dirname(PACKAGE), "docs", "architecture.md")


def test_every_file_the_architecture_names_exists():
    """docs/architecture.md walks a token through files by their paths (``megatron/hasher.py``); a renamed
    or removed file fails here, not in a reader's hands."""
    import re

    text = open(ARCHITECTURE).read()
    root = os.path.dirname(PACKAGE)
    named = sorted(set(re.findall(r"`((?:[a-z_]+/)+[a-z_0-9]+\.py)`", text)))
    assert len(named) > 20
    missing = [path for path in named if not any(os.path.exists(os.path.join(base, path)) for base in (PACKAGE, root))]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_adapters_sizes_the_architecture_states_are_their_sizes():
    import re

    text = " ".join(open(ARCHITECTURE).read().split())

    def lines(*parts):
        return sum(sum(1 for _ in open(os.path.join(folder, name))) for part in parts
                   for folder, _, files in os.walk(os.path.join(PACKAGE, part)) for name in files if name.endswith(".py"))

    stated = re.search(r"the Megatron one \(`megatron/`, `megatron_lm/`\) is about ([\d,]+) lines.*?the DeepSpeed one "
                       r"about ([\d,]+); the Hugging Face one about ([\d,]+); the vLLM one about ([\d,]+)\.", text)
    assert stated, "docs/architecture.md no longer states the adapters' sizes where this test reads them"
    for said, actual in zip((int(n.replace(",", "")) for n in stated.groups()),
                            (lines("megatron", "megatron_lm"), lines("deepspeed"), lines("hf"), lines("vllm"))):
        assert abs(said - actual) <= 0.05 * actual, f"docs/architecture.md says about {said} lines; there are {actual}"
