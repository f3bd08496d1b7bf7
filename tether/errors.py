"""User-facing errors: one line, names the file/row/flag and what is wrong; the CLI exits with code 2."""


class TetherError(Exception):
    """Bad input from the user (file, row, flag or config value). Printed as one line, exit code 2."""


class ConfigError(TetherError):
    """An invalid config key or value (YAML or command line)."""


class DataError(TetherError):
    """A data file that cannot be read: names the file, the line/row and what is wrong."""
