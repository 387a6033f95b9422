"""Where smp.init's config comes from: a dict, a JSON file, or the environment
(SMP_CONFIG, else SM_HP_MP_PARAMETERS, resolved by C++). Validation is C++'s
(smp_core/config.h); this module only finds the text."""
import json
import os

import smp._C as _C

__all__ = []

ConfigError = _C.ConfigError

_CONFIG_ACCEPTED = ('accepted: a dict, the path of an existing JSON file holding an object '
                    'like {"partitions": 2}, or None for env SMP_CONFIG)')


def config_text(config):
    """Resolves `config` (dict, JSON path, None) to JSON text.

    Raises:
        ConfigError: a path that does not exist, is not a file or holds no valid JSON,
            SMP_CONFIG holding a path instead of JSON, or a config of another type.
    """
    if config is None:
        raw = _C.config_from_environment()
        text = os.environ.get("SMP_CONFIG", "")
        if raw == text and not text.lstrip().startswith("{"):
            try:
                json.loads(text)
            except ValueError:
                what = "an existing file" if os.path.isfile(text) else "not JSON"
                raise ConfigError(
                    f"smp: environment SMP_CONFIG='{text}' is {what}; SMP_CONFIG holds the "
                    'JSON object itself, like {"partitions": 2} (smprun --config and '
                    "smp.init(config=path) read a file)") from None
        return raw
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.exists(path):
            raise ConfigError(f"smp: config file '{path}' does not exist ({_CONFIG_ACCEPTED}")
        if not os.path.isfile(path):
            raise ConfigError(f"smp: config path '{path}' is not a file ({_CONFIG_ACCEPTED}")
        with open(path) as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"smp: config file '{path}' is not valid JSON: {exc} "
                              f"({_CONFIG_ACCEPTED}") from None
        return text
    raise ConfigError(f"smp: config of type {type(config).__name__} is not supported "
                      f"({_CONFIG_ACCEPTED}")


def timeout_of(raw):
    """The config's timeout_s, or 300 s when the config does not parse (smp.init's
    exchange then reports the error on every rank)."""
    try:
        return json.loads(_C.parse_config(raw))["timeout_s"]
    except (ConfigError, ValueError):
        return 300.0
