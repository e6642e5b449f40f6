"""fastelastic: a faster, drop-in replacement for ``torch.distributed.elastic``.

What torch has at ``torch.distributed.elastic.X`` lives here at ``fastelastic.X``; the key-value
store is :mod:`fastelastic.store`.
"""

__version__ = "0.1.0"
