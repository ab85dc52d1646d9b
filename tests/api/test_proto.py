"""tx/api/proto.py: the wire protocol's protobuf module without the tinker package's __init__ (which imports the
SDK and PyTorch), and one module object whether the SDK is imported after tx.api or before."""

import subprocess
import sys

from tests.helpers import one_device_env

AFTER = """
import sys
import tx.api.app, tx.run
assert "tinker" not in sys.modules and "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith(("tinker", "torch")))[:5]
from tx.api.proto import pb
import tinker
from tinker.proto import request_conv, response_conv, tinker_public_pb2
assert request_conv.public_pb is pb and response_conv.public_pb is pb and tinker_public_pb2 is pb
print("ok")
"""


def test_the_server_imports_no_torch_and_the_sdk_shares_the_module():
    proc = subprocess.run([sys.executable, "-c", AFTER], env=one_device_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_one_module_in_a_process_that_imports_both():
    """This process imports the SDK for other tests too (in either order with tx.api): one module object."""
    import tinker.proto.tinker_public_pb2 as sdk_pb

    from tx.api.proto import load_public_pb2, pb

    assert pb is sdk_pb and load_public_pb2() is sdk_pb
