"""Checkpoints held in the agent's memory: ``save``, ``async_save`` and ``load``.

Call them in a script that fastrun started, with the argument names of
``torch.distributed.checkpoint``::

    import fastelastic.checkpoint as fc

    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    step = fc.load(state)                  # None on the first start
    if step is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    for step in range((step or 0) + 1, steps + 1):
        train_one_step()
        fc.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, step=step,
                checkpoint_id=f"ckpt/step-{step}")    # optional: the disk copy

The state lives in memory the node's agent owns, so it survives a worker's crash or a hang
verdict: the restarted workers restore the newest step that every local rank saved whole, its
MAC checked. It does not survive the agent (a node's loss, or fastrun's exit). With a
``checkpoint_id``, the agent also writes the step there behind training, in torch DCP's
format (torch's ``dcp.load`` with a ``FileSystemReader`` reads it); ``latest(path)`` finds the
newest step written whole.

The agent's side (``_owner``) never imports torch; this package's ``__init__`` does not either.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from fastelastic.checkpoint._owner import CheckpointError, start_early_map

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = ["CheckpointError", "SaveHandle", "Latest", "save", "async_save", "load", "latest"]

start_early_map()  # a restarted worker maps its restore buffer while its script starts


class SaveHandle(int):
    """The step ``save`` saved (an int); ``wait()`` waits for its disk copy."""

    def wait(self, timeout: Optional[float] = None) -> str:
        """Returns once the agent is done with this step's disk copy: ``"written"`` (whole in
        its ``checkpoint_id``), ``"skipped"`` (a newer step was whole before this one was
        written: the newer one is written instead) or ``"memory"`` (saved with no
        ``checkpoint_id``).

        Raises:
            CheckpointError: the write failed (the message says why), or ``timeout`` ran out.
        """
        from fastelastic.checkpoint import _worker

        return _worker.disk_wait(int(self), timeout)


class Latest(NamedTuple):
    step: int
    checkpoint_id: str


def latest(path: str | os.PathLike) -> Optional[Latest]:
    """The newest step written whole at ``path``: ``path`` itself when it is a step's
    directory, else the newest of its subdirectories (from the marker the agent writes last).
    None when there is none. Needs neither torch nor fastrun."""
    from fastelastic.checkpoint import _disk

    found = _disk.latest(os.fspath(path))
    return None if found is None else Latest(*found)


def _next_step(step: Optional[int]) -> int:
    from fastelastic.checkpoint import _worker

    if step is not None:
        return int(step)
    ch = _worker.channel()
    return ch.last_step + 1


def save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
         step: Optional[int] = None) -> SaveHandle:
    """Copies ``state_dict`` into the agent's memory; returns once every local rank's state of
    this step is there.

    It is not on disk when this returns: the copy lives in memory the node's agent owns, which
    outlives a crashed or restarted worker but not the agent itself. With a ``checkpoint_id``
    the agent writes the step there behind training; the handle's ``wait()`` waits for that.

    Args:
        state_dict: tensors (any device; copied to host memory) and picklable items, nested in
            dicts, lists and tuples, as for ``torch.distributed.checkpoint.save``.
        checkpoint_id: the step's directory, as for ``torch.distributed.checkpoint``: the agent
            writes it there in DCP's format (``__<rank>_0.distcp`` files and ``.metadata``),
            whole or not at all. None: memory only.
        step: the training step this state belongs to; default: one after the last step this
            process saved or loaded (1 on the first start).

    Returns:
        The step saved (an int), whose ``wait()`` waits for the disk copy.

    Raises:
        CheckpointError: not under fastrun, no room for the state (one line naming the limit
            and the fix), or a local rank did not save this step.
    """
    from fastelastic.checkpoint import _worker

    return SaveHandle(_worker.stage(state_dict, _next_step(step), wait=True,
                                    checkpoint_id=checkpoint_id))


def async_save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
               step: Optional[int] = None) -> Future:
    """Copies ``state_dict`` into the agent's memory and returns at once after the copy.

    The returned Future's ``result()`` is the step, once every local rank's state of that step
    is in the agent's memory (not on disk); its ``wait()`` waits for the disk copy, as
    ``SaveHandle.wait``. Arguments as for ``save``.
    """
    from fastelastic.checkpoint import _worker

    s = _worker.stage(state_dict, _next_step(step), checkpoint_id=checkpoint_id)
    return _worker.wait_future(s)


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None) -> Optional[int]:
    """Restores this round's step from the agent's memory into ``state_dict``, in place.

    Every local rank restores the same step: the newest one for which the agent holds every
    local rank's shard whole, its MAC checked. Tensors are copied into the tensors of
    ``state_dict`` with the same key, shape and dtype; other saved items (and tensors absent
    from ``state_dict``, e.g. Adam's state in a new optimizer) are put in place of the old.

    Args:
        state_dict: the dict to restore into (as for ``torch.distributed.checkpoint.load``).
        checkpoint_id: as for ``torch.distributed.checkpoint``; memory only, for now.

    Returns:
        The step restored, or None when the agent holds no step every local rank saved.
    """
    from fastelastic.checkpoint import _worker

    return _worker.restore(state_dict)
