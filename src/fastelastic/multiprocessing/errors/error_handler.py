"""Owns ErrorHandler: writes a worker's exception to TORCHELASTIC_ERROR_FILE as torch's JSON."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import time
import traceback
import warnings
from typing import Any

__all__ = ["ErrorHandler"]

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class ErrorHandler:
    """Records an exception, with its traceback and a timestamp, as JSON in the error file.

    The file named by ``TORCHELASTIC_ERROR_FILE`` gets exactly the layout torch's handler
    writes (``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp":
    ...}}}``), so torch's agent reads our workers' files and we read torch's. Subclass it and
    override ``initialize()`` / ``record_exception()`` to customise.
    """

    def _get_error_file_path(self) -> str | None:
        """Returns the error file path, or None to only log the error."""
        return os.environ.get(ERROR_FILE_ENV, None)

    def initialize(self) -> None:
        """Prepares to capture errors: enables ``faulthandler`` for every thread."""
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError, AttributeError) as e:  # no usable stderr
            warnings.warn(f"Unable to enable fault handler. {type(e).__name__}: {e}", stacklevel=2)

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        try:
            with open(file_path, "w") as fp:
                fp.write(error_msg)
        except OSError as e:
            warnings.warn(f"Unable to write error to file. {type(e).__name__}: {e}", stacklevel=2)

    def record_exception(self, e: BaseException) -> None:
        """Writes ``e`` (with the traceback being handled) into the error file, if one is set.

        Args:
            e: the exception; call from inside the ``except`` block handling it.
        """
        file = self._get_error_file_path()
        if not file:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        self._write_error_file(file, json.dumps(data))

    def override_error_code_in_rootcause_data(
        self, rootcause_error_file: str, rootcause_error: dict[str, Any], error_code: int = 0
    ) -> None:
        """Sets ``errorCode`` in a child's error data (the child cannot know it when signalled)."""
        message = rootcause_error.get("message")
        if message is None:
            logger.warning(
                "child error file (%s) has no field `message`; cannot override error code %s",
                rootcause_error_file,
                error_code,
            )
        elif isinstance(message, str):
            logger.warning(
                "child error file (%s) has a new message format; skipping error code override",
                rootcause_error_file,
            )
        else:
            message["errorCode"] = error_code

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copies a child's error file into this process's error file, with ``error_code``.

        Args:
            rootcause_error_file: the failed child's error file.
            error_code: the child's exit code (written as ``errorCode`` when non-zero).
        """
        with open(rootcause_error_file) as fp:
            rootcause_error = json.load(fp)
        if error_code:
            self.override_error_code_in_rootcause_data(
                rootcause_error_file, rootcause_error, error_code
            )
        my_error_file = self._get_error_file_path()
        if not my_error_file:
            logger.error(
                "no error file defined for parent, to copy child error file (%s)",
                rootcause_error_file,
            )
            return
        # A child started with our environment may already have written into our file.
        if os.path.isfile(my_error_file):
            logger.warning("%s already exists and will be overwritten", my_error_file)
            os.remove(my_error_file)
        self._write_error_file(my_error_file, json.dumps(rootcause_error))
        logger.info("dumped error file to parent's %s", my_error_file)
