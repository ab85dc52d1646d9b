"""The Tinker wire protocol's generated protobuf module (`tinker.proto.tinker_public_pb2`), loaded without running
the `tinker` package's `__init__`: that imports the whole SDK client and, through its tensor types, PyTorch (2.2 of
a server's 7 s of imports, and torch's memory, for a module that needs only protobuf).

The module is registered in `sys.modules` under its own name, so a later `import tinker` in the same process (the
SDK's `from tinker.proto import tinker_public_pb2`) finds this module object and its messages stay one set of
types. Where `tinker` is already imported, the ordinary import is used."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "tinker.proto.tinker_public_pb2"


def load_public_pb2() -> ModuleType:
    """`tinker.proto.tinker_public_pb2`, imported from its file when the `tinker` package is not imported yet."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    if "tinker" in sys.modules:
        return importlib.import_module(NAME)
    spec = importlib.util.find_spec("tinker")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tinker SDK is not installed: tx's API speaks its wire protocol (pip install tinker)")
    path = Path(list(spec.submodule_search_locations)[0]) / "proto" / "tinker_public_pb2.py"
    module_spec = importlib.util.spec_from_file_location(NAME, path) if path.is_file() else None
    if module_spec is None or module_spec.loader is None:
        return importlib.import_module(NAME)  # an unusual install layout: the ordinary import
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[NAME] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise
    return module


pb = load_public_pb2()
