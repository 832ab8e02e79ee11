"""``atorch.common.log_utils``: a stdlib logger named as ATorch's, with its time / level / place format."""

from __future__ import annotations

import logging

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"


def get_logger(name: str, level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:  # once per name, as a second import must not print every line twice
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logger


default_logger = get_logger("atorch")

__all__ = ["default_logger", "get_logger"]
