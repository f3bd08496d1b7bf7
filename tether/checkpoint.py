"""Checkpoints of a PPO run (B14), written atomically: a temporary folder renamed into place, so the
newest complete checkpoint is always loadable and a crash loses at most the work since it.

A checkpoint ``DIR/checkpoints/step_000K/`` holds ``policy/`` (the LoRA adapter, or the full model,
saved by ``save_pretrained`` in safetensors), ``critic.safetensors`` (none for a critic-free run), and
``trainer_state.pt`` (optimisers, schedulers, KL controller, reward normaliser, RNG states, data position,
step), read back with ``torch.load(weights_only=True)``.

Durability: every file of a checkpoint is fsync'd, then the folder, then (after the rename) its parent
folder, so a power cut or kill -9 leaves either the previous checkpoint or the new one, never a
half-written folder under the final name. No non-finite weight is ever written (:func:`check_finite`).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
                  and (p / "trainer_state.pt").is_file())


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fsync_path(path: Path) -> None:
    """Flush a file or a folder's entries to disk (folders: where the OS allows opening them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. folders on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder, deepest first (files before the names)."""
    folders = []
    for folder, _, files in os.walk(root):
        folders.append(Path(folder))
        for name in files:
            fsync_path(Path(folder) / name)
    for folder in reversed(folders):
        fsync_path(folder)


def check_finite(model, what: str, state_dict: dict | None = None) -> None:
    """Refuse to write weights holding NaN/Inf (B16): the caller keeps its last good checkpoint. ``state_dict``:
    the full tensors to check instead of the module's own (a sharded module holds only its shard)."""
    from tether.errors import TetherError

    named = state_dict.items() if state_dict is not None else model.named_parameters()
    for name, p in named:
        if torch.is_floating_point(p) and not torch.isfinite(p.detach()).all():
            raise TetherError(f"{what}: parameter {name} holds NaN/Inf; not saved (the last complete checkpoint "
                              f"is kept)")


def clean_temporary(run_dir: Path) -> None:
    """Remove the temporary and replaced files and folders a killed process left in the run directory and
    under ``checkpoints/`` (call it before anything is written: the names carry no owner but a pid). A folder
    replaced by :func:`atomic_dir` whose new copy never arrived (killed between its two renames) is put back."""
    for root in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if root.is_dir():
            for p in sorted(root.iterdir()):
                name = p.name[len(".old-"):].rsplit("-", 1)[0]
                if p.name.startswith(".old-") and p.is_dir() and not (root / name).exists():
                    os.replace(p, root / name)  # the previous copy is the complete one
                    continue
                if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.name.startswith((".tmp-", ".old-")):
                    p.unlink(missing_ok=True)


def refuse_foreign_dir(out_dir: Path, metadata_file: str, what: str) -> None:
    """Refuse to replace a non-empty ``out_dir`` that is neither a finished run of this stage (it holds
    ``metadata_file``) nor an unfinished one (only ``checkpoints/`` and atomic writes' leftovers): it is the
    user's data. ``what`` names the stage's output in the error (``a tether reward model``)."""
    from tether.errors import ConfigError

    ours = (out_dir / metadata_file).is_file() or (out_dir.is_dir() and all(
        p.name == "checkpoints" or p.name.startswith((".tmp-", ".old-")) for p in out_dir.iterdir()))
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not ours)):
        raise ConfigError(f"--output-dir {out_dir}: exists and is not {what}; refusing to replace it")


def atomic_dir(target: Path, write) -> Path:
    """Call ``write(tmp_dir)``, fsync it, then rename ``tmp_dir`` to ``target`` (replacing an older one)
    and fsync the parent folder so that the rename itself is durable."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    old = target.parent / f".old-{target.name}-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(run_dir: Path, step: int, policy_model, critic, trainer_state: dict, keep: int,
                    policy_state: dict | None = None, critic_state: dict | None = None, target: Path | None = None,
                    also=None) -> Path:
    """Write checkpoint ``step``; keep the ``keep`` newest. ``policy_state``/``critic_state``: full state
    dicts gathered from sharded models (FSDP2), written in place of the modules' own. Weights with NaN/Inf
    are refused (TetherError). ``critic`` None: a critic-free run, no critic file. ``target``: write the
    checkpoint there instead (``RUN_DIR/best``), outside the rotation; ``also(tmp_dir)``: more files written
    into the same temporary folder, so they appear with the weights or not at all."""
    check_finite(policy_model, f"checkpoint step {step}: policy", policy_state)
    if critic is not None:
        check_finite(critic, f"checkpoint step {step}: critic", critic_state)

    def write(tmp: Path):
        save_pretrained(policy_model, tmp / "policy", policy_state)
        if critic is not None:
            critic_state_ = critic.state_dict() if critic_state is None else critic_state
            save_file({k: v.detach().contiguous() for k, v in critic_state_.items()},
                      str(tmp / "critic.safetensors"))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if also is not None:
            also(tmp)

    path = atomic_dir(target if target is not None else checkpoint_dir(run_dir, step), write)
    if target is not None:  # not one of the periodic checkpoints: nothing rotates
        return path
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def save_pretrained(model, directory: Path, state_dict: dict | None = None) -> None:
    """``model.save_pretrained`` in safetensors, from ``state_dict`` when given. A sharded model's class is
    FSDP2's subclass (``FSDPGPT2LMHeadModel``): config.json names the plain class, which loaders expect."""
    if state_dict is not None:
        # A gathered state dict holds tied weights (lm_head = embeddings) as separate copies; the file the
        # model writes itself leaves the tied target out.
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        state_dict = {k: v for k, v in state_dict.items() if not (k in tied and tied[k] in state_dict)}
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    config_file = Path(directory) / "config.json"
    plain = next((c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP")), None) \
        if type(model).__name__.startswith("FSDP") else None
    if plain and config_file.is_file():
        import json

        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["architectures"] = [plain]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_checkpoint(path: Path, policy_model, critic) -> dict:
    """Restore weights in place and return the trainer state of checkpoint ``path``."""
    policy_dir = Path(path) / "policy"
    if hasattr(policy_model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy_model, load_file(str(policy_dir / "adapter_model.safetensors")))
    else:
        state = {}
        for f in sorted(policy_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = policy_model.load_state_dict(state, strict=False)
        tied = set(getattr(policy_model, "_tied_weights_keys", None) or [])
        if unexpected or any(k not in tied and not k.endswith("lm_head.weight") for k in missing):
            raise RuntimeError(f"{policy_dir}: checkpoint does not match the policy "
                               f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if critic is not None:
        critic.load_state_dict(load_file(str(Path(path) / "critic.safetensors")))
    return torch.load(Path(path) / "trainer_state.pt", weights_only=True)
