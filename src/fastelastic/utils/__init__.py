"""Helpers torch's elastic users import (``torch.distributed.elastic.utils`` at
``fastelastic.utils``): ``api``, ``distributed``, ``store``, ``logging``, ``data``.

Only ``data.ElasticDistributedSampler`` needs torch (it subclasses torch's
``DistributedSampler``); everything else works without it.
"""

from fastelastic.utils.api import get_env_variable_or_raise, get_socket_with_port, macros

__all__ = ["get_env_variable_or_raise", "get_socket_with_port", "macros"]
