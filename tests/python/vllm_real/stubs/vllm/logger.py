"""STUB vllm.logger: init_logger / logger with vLLM's *_once methods over stdlib logging (the
real module configures handlers from VLLM_LOGGING_* and patches the Logger class)."""
import logging


class _Logger(logging.LoggerAdapter):
    def __init__(self, logger):
        super().__init__(logger, {})
        self._seen = set()

    def _once(self, level, msg, *args, **kwargs):
        kwargs.pop("scope", None)
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name))


logger = init_logger("vllm")
