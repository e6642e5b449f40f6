"""What the file timer server logs when timers expire (torch's ``timer.debug_info_logging``)."""

from __future__ import annotations

from fastelastic.utils.logging import get_logger

__all__ = ["log_debug_info_for_expired_timers"]

logger = get_logger(__name__)


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[int, list[str]]) -> None:
    """Logs (INFO) the expired timers of ``run_id``: worker pid -> the expired requests (JSON)."""
    if expired_timers:
        logger.info("Timers expired for run:[%s] [%s].", run_id, expired_timers)
