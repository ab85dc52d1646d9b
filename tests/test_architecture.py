"""tx's structure, checked on its source: every `import` statement of tx/ (module level, inside functions and
under TYPE_CHECKING alike) points down the layer order of design.md, no modules import each other in a
circle, and no code reaches into another object's private members, so a later change cannot bring an
upward import, a circle or a private reach back unnoticed."""

import ast
from pathlib import Path

TX = Path(__file__).resolve().parents[1] / "tx"

# bottom to top; a module may import its own layer and those below
LAYERS = [
    {"types", "metrics", "log", "ranks", "registry", "version"},
    {"kernels"},
    {"models", "losses"},
    {"runtime"},
    {"sampling", "checkpoints", "export", "score"},
    {"backends"},
    {"engine", "distributed"},
    {"api", "training"},
    {"sft", "rl"},
    {"run", "__init__"},  # tx/__init__.py re-exports the backends: nothing inside tx imports the package root
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(TX.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in TX.rglob("*.py")}


def imports_of(path: Path, modules: set[str]) -> set[tuple[str, int]]:
    """(tx module imported, line) for every import statement in `path`; `from a import b` counts as an import
    of module a.b where that is a module, else of a."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import tx.models.qwen3.x` -> the module it names
                name = name.rpartition(".")[0]
            if name.startswith("tx") and name != me:
                found.add((name, node.lineno))
    return found


def top_part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[tuple[str, int]]]:
    modules = all_modules()
    return {m: imports_of(p, set(modules)) for m, p in modules.items()}


def test_every_part_of_tx_has_a_layer():
    assert {top_part(m) for m in all_modules()} <= set(LAYER_OF), set(map(top_part, all_modules())) - set(LAYER_OF)


def test_no_import_points_up_the_layers():
    upward = [f"{m} (layer {LAYER_OF[top_part(m)]}) imports {t} (layer {LAYER_OF[top_part(t)]}) at line {line}"
              for m, targets in graph().items() for t, line in targets
              if LAYER_OF[top_part(t)] > LAYER_OF[top_part(m)]]
    assert not upward, "\n".join(sorted(upward))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_modules_import_each_other_in_a_circle():
    edges = {m: {t for t, _ in targets} for m, targets in graph().items()}
    assert cycles(edges) == []


def test_the_sampling_engine_needs_nothing_from_the_backends():
    for m, targets in graph().items():
        if top_part(m) == "sampling":
            assert not [t for t, _ in targets if top_part(t) == "backends"], m


# private names of other libraries' objects that are their public API, or tx's own inherited methods
NOT_PRIVATE_REACH = {"_exit", "_replace", "_asdict", "_fields", "_make", "_src"}


def private_reaches(source: str) -> list[str]:
    """`x._name` where x is not self, cls or super(): reading another object's private member."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls") or node.attr in NOT_PRIVATE_REACH:
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_reach_finder_finds_reaches():
    assert private_reaches("self._a\nsuper()._b()\nos._exit(1)\nengine._store\nx.y._z") == \
        ["line 4: engine._store", "line 5: x.y._z"]


def test_no_code_reads_another_objects_private_members():
    reaches = [f"{module}: {r}" for module, path in sorted(all_modules().items())
               for r in private_reaches(path.read_text())]
    assert not reaches, "\n".join(reaches)
