"""Silences robosuite's "No private macro file found!" warnings, which it prints on every import.

robosuite 1.4 warns three times at import when ``robosuite/macros_private.py`` does not exist (its optional
per-user settings file, which nothing here needs). `quiet_robosuite_macros` drops exactly those three messages,
with a filter on robosuite's logger installed before the import; every other robosuite message is kept.
"""

from __future__ import annotations

import logging

ROBOSUITE_LOGGER = "robosuite_logs"
"""The logger robosuite's ``ROBOSUITE_DEFAULT_LOGGER`` writes to."""
MACRO_MESSAGES = ("No private macro file found", "It is recommended to use a private macro file", "setup_macros.py")
"""Fragments of the three import-time warnings."""


class _MacroWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(fragment in message for fragment in MACRO_MESSAGES)


def quiet_robosuite_macros() -> None:
    """Installs the filter on robosuite's logger (once per process; call before importing LIBERO/robosuite).

    Example:
        >>> quiet_robosuite_macros()
        >>> logging.getLogger(ROBOSUITE_LOGGER).filter(logging.makeLogRecord({"msg": "No private macro file found!"}))
        False
    """
    logger = logging.getLogger(ROBOSUITE_LOGGER)
    if not any(isinstance(f, _MacroWarningFilter) for f in logger.filters):
        logger.addFilter(_MacroWarningFilter())
