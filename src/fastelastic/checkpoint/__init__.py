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
        fc.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, step=step)

The state lives in memory the node's agent owns, so it survives a worker's crash or a hang
verdict: the restarted workers restore the newest step that every local rank saved whole, its
MAC checked. It does not survive the agent (a node's loss, or fastrun's exit): this is not a
copy on disk.

The agent's side (``_owner``) never imports torch; this package's ``__init__`` does not either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fastelastic.checkpoint._owner import CheckpointError

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = ["CheckpointError", "save", "async_save", "load"]


def _next_step(step: Optional[int]) -> int:
    from fastelastic.checkpoint import _worker

    if step is not None:
        return int(step)
    ch = _worker.channel()
    return ch.last_step + 1


def save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
         step: Optional[int] = None) -> int:
    """Copies ``state_dict`` into the agent's memory; returns once every local rank's state of
    this step is there.

    It is not on disk when this returns: the copy lives in memory the node's agent owns, which
    outlives a crashed or restarted worker but not the agent itself.

    Args:
        state_dict: tensors (any device; copied to host memory) and picklable items, nested in
            dicts, lists and tuples, as for ``torch.distributed.checkpoint.save``.
        checkpoint_id: the checkpoint's path, as for ``torch.distributed.checkpoint``; kept
            for the disk copies (memory only, for now: the argument is accepted and unused).
        step: the training step this state belongs to; default: one after the last step this
            process saved or loaded (1 on the first start).

    Returns:
        The step saved.

    Raises:
        CheckpointError: not under fastrun, no room for the state (one line naming the limit
            and the fix), or a local rank did not save this step.
    """
    from fastelastic.checkpoint import _worker

    return _worker.stage(state_dict, _next_step(step), wait=True)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
               step: Optional[int] = None) -> Future:
    """Copies ``state_dict`` into the agent's memory and returns at once after the copy.

    The returned Future's ``result()`` is the step, once every local rank's state of that step
    is in the agent's memory (not on disk). Arguments as for ``save``.
    """
    from fastelastic.checkpoint import _worker

    s = _worker.stage(state_dict, _next_step(step))
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
