"""mkernel communicators over Megatron-core's process groups.

One `Communicators` object serves one model: it holds the tensor-, context- and
expert-parallel process groups the model is built with, and creates an mkernel
communicator over each group the first time a layer asks for it (`Communicator(group)`:
rank 0 of the group makes the unique id, the group broadcasts it). Every layer that
asks for the same role gets the same communicator back; `close()` destroys them all,
and a model's `Communicators` is closed when the object is collected with the model
that holds it.

A layer asks with the group it was built with (Megatron hands each module its
`pg_collection`); a group other than the one this object was made with, or a size that
disagrees with the config's parallel size, is refused with a message naming the group.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..comm import Communicator
from ..errors import MkInvalidUsageError

# role -> (Megatron's name for the group, the TransformerConfig field with its size)
ROLES = {
    "tp": ("tensor-parallel (tp)", "tensor_model_parallel_size"),
    "cp": ("context-parallel (cp)", "context_parallel_size"),
    "ep": ("expert-parallel (ep)", "expert_model_parallel_size"),
}


def _group_size(group) -> int:
    return torch.distributed.get_world_size(group)


def _group_rank(group) -> int:
    return torch.distributed.get_rank(group)


def _close_all(made: dict) -> None:
    # A finalizer: holds the communicators, never the Communicators object.
    for comm in list(made.values()):
        comm.close()
    made.clear()


class Communicators:
    """The mkernel communicators of one model, one per parallel group, created on first use.

    Args:
        tp_group, cp_group, ep_group: the model's tensor-, context- and expert-parallel
            process groups. None: the groups of megatron.core.parallel_state (which must be
            initialized), the same ones Megatron's layers default to.
        factory: makes a communicator over a group, `factory(group, name=...)`; default
            `mkernel.Communicator` with `communicator_options`.
        **communicator_options: passed to `mkernel.Communicator` (timeout,
            workspace_bytes, max_ctas, ...).

    `for_group(role, group, config)` returns the communicator of `role` ("tp", "cp", "ep")
    after checking that `group` is this object's group of that role and that its size is
    the config's parallel size. `close()` (or leaving a `with` block) destroys every
    communicator it made; so does collecting the object.
    """

    def __init__(self, *, tp_group=None, cp_group=None, ep_group=None, factory: Callable | None = None,
                 **communicator_options):
        given = {"tp": tp_group, "cp": cp_group, "ep": ep_group}
        if any(group is None for group in given.values()):
            from megatron.core import parallel_state

            if not parallel_state.model_parallel_is_initialized():
                raise MkInvalidUsageError(
                    "mkernel.megatron.Communicators: megatron.core.parallel_state is not initialized; call "
                    "parallel_state.initialize_model_parallel(...) first, or pass tp_group, cp_group and ep_group"
                )
            defaults = {
                "tp": parallel_state.get_tensor_model_parallel_group,
                "cp": parallel_state.get_context_parallel_group,
                "ep": parallel_state.get_expert_model_parallel_group,
            }
            given = {role: group if group is not None else defaults[role]() for role, group in given.items()}
        self.groups = given
        self._factory = factory if factory is not None else self._communicator
        self._options = communicator_options
        self._made: dict[str, object] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._made)

    def _communicator(self, group, *, name: str):
        return Communicator(group, name=name, **self._options)

    def for_group(self, role: str, group, config=None):
        """The communicator over `group` as this model's `role` group; made on the first call."""
        if role not in ROLES:
            raise MkInvalidUsageError(
                f"mkernel.megatron.Communicators: unknown group role {role!r}; supported: {', '.join(ROLES)}"
            )
        what, size_field = ROLES[role]
        mine = self.groups[role]
        if group is not None and group is not mine:
            raise MkInvalidUsageError(
                f"mkernel.megatron: the layer's {what} group (size {_group_size(group)}) is not the {what} group "
                f"these Communicators were made with (size {_group_size(mine)}); build the model with the same "
                "process groups as its Communicators"
            )
        size = _group_size(mine)
        if config is not None:
            expected = getattr(config, size_field)
            if expected != size:
                raise MkInvalidUsageError(
                    f"mkernel.megatron: the {what} group has {size} ranks but config.{size_field} = {expected}; "
                    "the config and the process groups must agree"
                )
        comm = self._made.get(role)
        if comm is None:
            if not self._finalizer.alive:
                raise MkInvalidUsageError("mkernel.megatron.Communicators: closed; make new Communicators")
            comm = self._factory(mine, name=f"megatron-{role}:{id(self):x}")
            self._made[role] = comm
        if comm.world_size != size or comm.rank != _group_rank(mine):
            raise MkInvalidUsageError(
                f"mkernel.megatron: the {what} communicator {comm.name!r} is rank {comm.rank} of {comm.world_size}, "
                f"but this process is rank {_group_rank(mine)} of {size} in the {what} group"
            )
        return comm

    def made(self) -> dict[str, object]:
        """The communicators created so far, by role."""
        return dict(self._made)

    def close(self) -> None:
        """Destroys every communicator this object made (each rank closes its own)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Communicators":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{role}={_group_size(group)}" for role, group in self.groups.items())
        return f"mkernel.megatron.Communicators({sizes}, made={sorted(self._made)}, closed={self.closed})"
