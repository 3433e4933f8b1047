"""The command line and the TOML file to a validated JobConfig: TorchTitan's
parser with our sections merged in, unknown keys and wrong types refused in
one line naming the key, then the start-up checks (config/checks.py).
"""

from __future__ import annotations

import logging

from torchtitan_grpo.config.checks import ConfigError, _check_toml_keys, validate
from torchtitan_grpo.config.job_config import CONFIG_MODULE, JobConfig
from torchtitan_grpo.config.keys import check_cli_args


def parse_config(argv: list[str]):
    """Parse ``--job.config_file X.toml`` plus CLI overrides into a validated JobConfig.

    Our sections are merged in through ``--job.custom_config_module``. An
    unknown key (in the file or on the command line), a value of the wrong
    type and a bad value of ours each raise a one-line ConfigError naming the
    key (and the nearest valid key for a misspelled one).
    """
    from torchtitan.config import ConfigManager

    argv = list(argv)
    if not any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in argv):
        argv += ["--job.custom_config_module", CONFIG_MODULE]
    _check_toml_keys(argv)
    argv = _bool_values_to_flags(argv)
    check_cli_args(argv, _merged_keys(), ConfigError)  # one line, before tyro's box
    quiet = _NoMissingAssetsWarning()
    logging.getLogger().addFilter(quiet)  # TorchTitan logs on the root logger
    try:
        cfg = _tyro_in_one_line(lambda: ConfigManager().parse_args(argv))
    finally:
        logging.getLogger().removeFilter(quiet)
    validate(cfg)
    return cfg


def _merged_keys() -> dict:
    """Every key of TorchTitan's JobConfig and ours, with its type and default (config/keys.py)."""
    from torchtitan.config import ConfigManager
    from torchtitan.config import JobConfig as TitanJobConfig

    from torchtitan_grpo.config.keys import key_types

    return key_types(ConfigManager._merge_configs(TitanJobConfig, JobConfig))


def _tyro_in_one_line(parse):
    """``parse()``, with an error tyro still finds (one check_cli_args does not
    make, e.g. a stray word) raised as a ConfigError of one line instead of
    its box on stderr; --help is printed as tyro writes it."""
    import contextlib
    import io
    import sys

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse()
    except SystemExit as e:
        if e.code in (0, None):
            sys.stderr.write(err.getvalue())
            raise
        # tyro's message sits between the first two rules: below the title (in a box, the
        # top edge is the first rule; without a terminal a plain title line comes before
        # it) and above the help text, wrapped to the terminal's width; joined into one line.
        rows = [row.strip("\u2502\u2570\u256f ") for row in err.getvalue().splitlines()]
        rules = [k for k, row in enumerate(rows) if row.startswith("\u256d") or (row and set(row) <= {"\u2500", "-"})]
        part = rows[rules[0] + 1:rules[1] if len(rules) > 1 else None] if rules else rows
        text = " ".join(" ".join(part).split())
        raise ConfigError(f"command line: {text or 'not understood'}") from None


def _bool_values_to_flags(argv: list[str]) -> list[str]:
    """``--a.b true|false|1|0|yes|no`` (or ``=value``) for a boolean key of
    TorchTitan's or ours becomes tyro's ``--a.b`` / ``--a.no_b`` (config/cli_bools.py)."""
    from torchtitan.config import ConfigManager
    from torchtitan.config import JobConfig as TitanJobConfig

    from torchtitan_grpo.config.cli_bools import bool_keys, rewrite_bool_args

    return rewrite_bool_args(argv, bool_keys(ConfigManager._merge_configs(TitanJobConfig, JobConfig)), ConfigError)


class _NoMissingAssetsWarning(logging.Filter):
    """TorchTitan warns "HF assets path X does not exist!" while parsing. Here
    such a path is either written just after (``grpo.tiny_model_if_missing``:
    the demo's first run would open with that warning) or refused by
    :func:`validate` with the key named, so the warning only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("HF assets path ") and "does not exist" in record.getMessage())
