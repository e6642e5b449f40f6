"""The default log level of torch's elastic loggers."""

__all__ = ["get_log_level"]


def get_log_level() -> str:
    """Returns the level loggers of ``get_logger`` get when ``LOGLEVEL`` is unset."""
    return "WARNING"
