"""Shared fixtures. CPU tests use `shape_comm`, a registered stand-in that has a world size
but no library handle: enough for the public functions, which look a communicator up for
its name and world size, and for the ops' checks that run before a launch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch

import mkernel
from mkernel import comm as comm_registry

_ids = itertools.count()


def pytest_report_header(config):
    return [
        f"mkernel {mkernel.__version__} from {mkernel.__file__}",
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}",
    ]


@dataclass
class ShapeOnlyComm:
    """Registered under `name` like a Communicator; has no device handle (launching fails)."""

    world_size: int
    rank: int = 0
    device: int = 0
    name: str = field(default_factory=lambda: f"test-shape-comm:{next(_ids)}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.device)

    def handle(self):
        raise AssertionError("a shape-only communicator cannot launch")


@pytest.fixture
def shape_comm():
    made = []

    def make(world_size: int, rank: int = 0, name: str | None = None) -> ShapeOnlyComm:
        c = ShapeOnlyComm(world_size, rank) if name is None else ShapeOnlyComm(world_size, rank, name=name)
        comm_registry.register(c)
        made.append(c)
        return c

    yield make
    for c in made:
        comm_registry.unregister(c.name)
