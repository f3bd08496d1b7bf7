"""Resolve a model argument (a local Hugging Face directory, or a named preset) to a local directory."""

from __future__ import annotations

from pathlib import Path

from tether.errors import TetherError


def resolve_model_path(name_or_path: str, *, what: str = "model") -> Path:
    """Return the local directory for ``name_or_path``; one-line error when it is not a model directory."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise TetherError(f"{name_or_path}: {what} directory not found")
    if not path.is_dir():
        raise TetherError(f"{name_or_path}: {what} must be a directory holding config.json")
    if not (path / "config.json").is_file():
        raise TetherError(f"{name_or_path}: not a Hugging Face model directory (no config.json)")
    return path
