"""smp's logging: Python's `logging` under the logger `smp` (children `smp.partition`,
`smp.pipeline`, ...), level from the environment variable `SMP_LOG_LEVEL`.

- Default (INFO): one line per event worth knowing, e.g. the partition summary, written
  once by rank 0. DEBUG adds detail (the whole partition table). WARNING and above:
  only problems. Failures are logged at ERROR (the step x rank table of a failed step).
- smp is a library, so it never configures the root logger (no `logging.basicConfig`).
  While the application has configured no logging at all, smp's own handler writes
  smp's records to stderr (`%(message)s`; every message starts with "smp"). As soon as
  the application has handlers (on the root logger, or on `smp` or a child of it), that
  handler stands aside and smp's records go where the application sends them, at the
  application's level: with `SMP_LOG_LEVEL` unset and logging configured before
  `smp.init()`, the `smp` logger inherits the root logger's level; a level the
  application set on the `smp` logger itself is kept.
- `SMP_LOG_LEVEL` (case-insensitive: CRITICAL, ERROR, WARNING, INFO, DEBUG), when set,
  is the `smp` logger's level whatever else is configured. Any other value raises
  `smp.ConfigError` from `smp.init()`, naming the variable, the value and the allowed
  names.
"""
import logging
import os
import sys

import smp._C as _C

__all__ = []

ENV = "SMP_LOG_LEVEL"
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
ROOT = "smp"


def get_logger(name=None):
    """The logger `smp` (name None) or `smp.<name>`."""
    return logging.getLogger(ROOT if not name else f"{ROOT}.{name}")


class _DefaultHandler(logging.Handler):
    """smp's handler on the `smp` logger: stderr (whatever `sys.stderr` is at the time
    of the record, as logging's own last resort), only while the application has no
    handler of its own that the record would reach."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record):
        if _application_handles(record.name):
            return
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's own rule: never raise from emit)
            self.handleError(record)


def _application_handles(name):
    """True if a handler other than smp's sees records of logger `name`."""
    logger = logging.getLogger(name)
    while logger is not None:
        if any(not isinstance(h, _DefaultHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def parse_level(value):
    """`SMP_LOG_LEVEL`'s value -> a logging level.

    Raises:
        ConfigError: `value` is not one of LEVELS (any case).
    """
    name = value.strip().upper()
    if name not in LEVELS:
        raise _C.ConfigError(f"smp: environment {ENV}='{value}' is not one of "
                             f"{{{', '.join(LEVELS)}}} (case-insensitive)")
    return getattr(logging, name)


def configure():
    """Sets the `smp` logger's level and installs smp's handler (once). Called by
    smp.init(); idempotent.

    Raises:
        ConfigError: a bad `SMP_LOG_LEVEL` (see parse_level).
    """
    logger = get_logger()
    value = os.environ.get(ENV, "")
    if value.strip():
        logger.setLevel(parse_level(value))
    elif logger.level == logging.NOTSET and not logging.getLogger().handlers:
        # No configuration anywhere: smp's default verbosity (the one-line summaries).
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        logger.addHandler(_DefaultHandler())


def _count(n):
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def log_partition(module_table, owner, partitions, table_fn, rank):
    """Logs the partition: a one-line summary at INFO, the full table at DEBUG.

    Args:
        module_table: [(name, module)] of the plain module, before partitioning.
        owner: {module name: partition}.
        partitions: the number of partitions.
        table_fn: returns the C++ plan's table (called only when DEBUG is on).
        rank: this process's rank (for the message).
    """
    logger = get_logger("partition")
    if not logger.isEnabledFor(logging.INFO):
        return
    params, seen = [0] * partitions, set()
    for name, module in module_table:
        for p in module.parameters(recurse=False):
            if id(p) not in seen:  # a tied parameter counts once, with its first owner
                seen.add(id(p))
                params[owner[name]] += p.numel()
    debug = logger.isEnabledFor(logging.DEBUG)
    logger.info("smp: partitioned %d modules into %d partitions: %s params (rank %d%s)",
                len(module_table), partitions, "/".join(_count(n) for n in params), rank,
                "" if debug else "; SMP_LOG_LEVEL=DEBUG for the table")
    if debug:
        logger.debug("smp: partition plan\n%s", table_fn())


_departures = [0]


def log_plan_departure(step, why, rank):
    """Note [Leaving the plan] (smp_core/detail/plan_execution.cpp): a training step whose
    calls departed from its plan. A warning the first time (the model's control flow
    differs between steps or microbatches), then at INFO."""
    _departures[0] += 1
    level = logging.WARNING if _departures[0] == 1 else logging.INFO
    get_logger("pipeline").log(
        level, "smp: step %d left its pipeline plan on rank %d: %s. The rest of the step ran "
        "without a list, by the plans' rule as work became ready (same numbers); the next "
        "step is planned from this step's calls where every microbatch made the same ones",
        step, rank, why)


def log_plan(text, rank):
    """Logs the pipeline plan a step executed (Note [Executed plan] in
    smp_core/detail/plan_execution.cpp): its first line at INFO, every rank's actions at
    DEBUG."""
    logger = get_logger("pipeline")
    if not logger.isEnabledFor(logging.INFO) or not text:
        return
    debug = logger.isEnabledFor(logging.DEBUG)
    logger.info("smp: executing the pipeline %s (rank %d%s)", text.split("\n", 1)[0], rank,
                "" if debug else "; SMP_LOG_LEVEL=DEBUG for every rank's actions")
    if debug:
        logger.debug("smp: pipeline plan\n%s", text.rstrip("\n"))
