"""Progress marks for the agent's hang check (``fastrun --hang-timeout``).

Optimizer steps (torch's global optimizer-step hook) count as progress, and ``torch.save``,
``torch.load``, ``torch.distributed.checkpoint`` and evaluation (``model.eval()`` until
``model.train()`` or the next optimizer step) suspend the check, with no change to the
script. A loop that uses none of these marks its own progress::

    import fastelastic.progress

    for batch in data:
        train_on(batch)
        fastelastic.progress.step()
    with fastelastic.progress.suspend():
        upload_checkpoint()

Both are no-ops in a process the agent does not check (not a rank, or the check is off).
"""

from fastelastic.progress._worker import step, suspend

__all__ = ["step", "suspend"]
