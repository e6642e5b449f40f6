"""Compiled modules (built from ``native/fastelastic/_native``); each has a ``.pyi`` stub here."""
