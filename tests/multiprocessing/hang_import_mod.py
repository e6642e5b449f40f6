"""Preloaded by the zygote tests: an import that never finishes (as on a hung filesystem)."""

import time

time.sleep(3600)
