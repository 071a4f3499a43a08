"""Atomic, resumable checkpoints.

Layout: `output_dir/checkpoints/step_000012/{model.safetensors, state.pt}` plus `output_dir/checkpoints/latest`,
a one-line pointer. A checkpoint is written into a temporary directory, renamed into place, and only
then does the pointer move (write + os.replace, atomic on POSIX). A crash at any moment leaves `latest`
naming a complete checkpoint. Weights are safetensors; optimizer and RNG state are loaded with
`torch.load(weights_only=True)`, so a checkpoint can never run code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(output_dir, step: int, model, optimizer, extra: dict, keep: int = 2) -> Path:
    root = _dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, tmp / "model.safetensors")
    rng = {"torch": torch.get_rng_state()}
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "rng": rng, "extra": extra}, tmp / "state.pt")
    for f in (tmp / "model.safetensors", tmp / "state.pt", tmp):
        _fsync(f)  # on disk before anything points at it
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    _fsync(pointer)
    os.replace(pointer, root / "latest")
    _fsync(root)
    for old in sorted(p for p in root.glob("step_*") if p != final)[: -max(keep - 1, 0) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir) -> Path | None:
    pointer = _dir(output_dir) / "latest"
    if not pointer.exists():
        return None
    path = _dir(output_dir) / pointer.read_text().strip()
    if not (path / "state.pt").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing; restore it or delete "
                                f"{pointer} to start over")  # fmt: skip
    return path


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore model, optimizer and RNG state; returns {'step': ..., 'extra': ...}."""
    model.load_state_dict(load_file(path / "model.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")  # the optimizer moves it to its params
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    return {"step": state["step"], "extra": state["extra"]}
