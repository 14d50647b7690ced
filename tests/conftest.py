"""Test-wide switch: compiled kernels on a GPU, Triton's interpreter on CPU tensors otherwise.

It must run before anything imports ``triton``, so it decides without importing torch's CUDA
machinery beyond ``torch.cuda.is_available()`` (which does not import triton). Override with
``FUSEDPAR_TEST_DEVICE=cpu`` (interpreter even on a GPU machine) or ``=cuda``.
"""
import os
import re

import torch

_choice = os.environ.get("FUSEDPAR_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
if _choice not in ("cpu", "cuda"):
    raise ValueError(f"FUSEDPAR_TEST_DEVICE must be 'cpu' or 'cuda', got {_choice!r}")
if _choice == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    import sys

    if "triton" in sys.modules:
        # triton reads the variable at import; an earlier import would leave kernels compiled
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
else:
    os.environ.pop("TRITON_INTERPRET", None)
os.environ["FUSEDPAR_TEST_DEVICE"] = _choice  # spawned distributed workers inherit the decision
# the cross-rank agreement check runs in every test world, NCCL ones included (its default is off there)
os.environ.setdefault("FUSEDPAR_CHECK_AGREEMENT", "1")

import pytest  # noqa: E402

DEVICE = torch.device(_choice)


@pytest.fixture
def device():
    return DEVICE


def pytest_report_header(config):
    mode = "compiled kernels on CUDA" if _choice == "cuda" else "Triton interpreter on CPU tensors"
    return f"fusedpar: {mode}"


def pytest_collection_modifyitems(config, items):
    # tests that use a multi-process world fixture (tests/_world.py names them world2, world3, ...)
    # get the `world` marker, so that `-m "not world"` runs only the in-process tests
    for item in items:
        if any(re.fullmatch(r"world\d+(_\w+)?", name) for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.world)
    if _choice == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (compiled kernels)")
    for item in items:
        # the marker itself, not `"gpu" in item.keywords`: keywords also hold the names of
        # parent directories, so a checkout in a folder named gpu/ would skip every test
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def world2_compile():
    """One gloo world of 2 shared by the torch.compile test modules (tests/test_torch_compile_*.py):
    Dynamo's and AOTAutograd's first-use warm-up (seconds per process) is paid once per rank."""
    from _world import World

    w = World(2)
    yield w
    w.close()
