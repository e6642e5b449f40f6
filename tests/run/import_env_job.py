"""Imports fe_import_env_mod (preloaded or not), then writes what dump_env.py writes."""

import os
import runpy
import sys
from pathlib import Path

# recorded for the test (which leaves it out of the comparison): forked by the zygote or not
os.environ["FE_WAS_PRELOADED"] = str(int("fe_import_env_mod" in sys.modules))
import fe_import_env_mod  # noqa: E402, F401

sys.argv[0] = str(Path(__file__).with_name("dump_env.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
