"""structlog set-up: key=value lines on stderr, bound with actor (and request) ids.

Level comes from TAIPAN_LOG_LEVEL (debug, info, warning, error; default warning so that the CLI
prints only results), or from `configure(level)`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(level: str | None = None) -> None:
    global _configured
    name = (level or os.environ.get("TAIPAN_LOG_LEVEL") or "warning").upper()
    value = getattr(logging, name, None)
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {name!r}; use debug, info, warning or error")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(value),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(**bound):
    if not _configured:
        configure()
    return structlog.get_logger().bind(**bound)
