"""Atomic, resumable checkpoints.

Layout: `output_dir/checkpoints/step_000012/{model.safetensors, state.pt}` plus `output_dir/checkpoints/latest`,
a one-line pointer. A checkpoint is written into a temporary directory, renamed into place, and only
then does the pointer move (write + os.replace, atomic on POSIX). A crash at any moment leaves `latest`
naming a complete checkpoint. Weights are safetensors; optimizer and RNG state are loaded with
`torch.load(weights_only=True)`, so a checkpoint can never run code.

A run also records the config it was started with (`output_dir/config.json`). Resuming with a different one
would silently splice two experiments into one set of weights and one metrics file, so a later start checks
the new config against the record and refuses, naming the keys that changed; only the keys of `RESUMABLE` may
differ (how long, how often to evaluate and checkpoint, the micro-batch and where it runs: the last two change the
updates by floating-point rounding only, and the dropout masks drawn), and the record takes their new values (a run
continued to 300 steps says max_steps 300).

It also records the weights it started from (`output_dir/start.json`: a digest of the initial state and the
machine). The lab model's warm start is trained on first use and cached; its training is deterministic on one
machine but not across CPUs (other kernels round differently; with `lab.target`, the SFT may stop at another
step), so two runs of one seed are a valid pair only when their starts agree (`same_start`). A run on a local dataset
records the file's resolved path and a digest of its contents there too: a resume or a scoring on a file edited
since is refused, and one on the same rows moved elsewhere goes on (`same_dataset`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import shutil
import stat
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: str | Path) -> dict:
    """One of a run's JSON records (config.json, start.json, branch.json); a ValueError naming the file when it
    does not parse (writes are atomic, so only a hand edit or another program leaves one so)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it from a copy, or delete it to have the run "
                         "record it anew") from e  # fmt: skip
    if not isinstance(record, dict):  # JSON, but not a record of aisrl's (a hand edit, another program)
        raise ValueError(f"{path} holds {type(record).__name__}, not a record (a JSON object); restore it from a "
                         "copy, or delete it to have the run record it anew")  # fmt: skip
    return record


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old file or the new one, and
    the new one's bytes are on disk (fsync) before the rename, so a power loss cannot leave it empty."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # one per writer
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # owns fd from here: closed whatever fails below
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)  # mkstemp's is 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)  # the rename itself survives a power loss


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a metrics file (empty if there is none). A last line that does not parse is a row whose append
    was cut short (the run was killed, the disk filled up): it is dropped, and its step is trained again on resume.
    A bad line anywhere else is an error naming the file and line."""
    path = Path(path)
    # bytes that are not UTF-8 (a line cut inside a character, a foreign file) fail that line's parse, not the read
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path} line {i + 1} is not JSON ({e}); only the last line of a metrics file may be "
                             "cut short. Remove the line (the steps after it are kept) to resume") from e  # fmt: skip
    return rows


RESUMABLE = ("max_steps", "eval_every", "checkpoint_every", "micro_batch", "output_dir", "device")
"""Config keys a run may change between starts: they decide how long it runs, how often it evaluates and
checkpoints, how the batch is split for memory and where it runs. Accumulation makes a new micro_batch the same
update up to floating-point rounding, not bit for bit, and with dropout on (lora.dropout) it draws other masks; a
resume that must equal the uninterrupted run keeps micro_batch (and device)."""


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict's names, dtypes, shapes and bytes, in name order (16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """The file's SHA-256, computed once for each version of it (path, size and modification time): a study's scoring
    and its aggregation both check a checkpoint's weights, and every start of a run checks its dataset."""
    st = Path(path).stat()
    return _sha256_of(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):  # streamed: a large file never sits in memory
            h.update(block)
    return h.hexdigest()


def dataset_sha256(path: str | Path) -> str:
    """SHA-256 of a local dataset's contents: a file's bytes, or a directory's files (names and bytes, in name
    order), so a dataset edited in place is told from the one a run trained on; 'missing' when the path does not
    exist."""
    root = Path(path)
    if root.is_file():
        return file_sha256(root)
    if not root.is_dir():
        return "missing"
    h = hashlib.sha256()
    for f in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(root).as_posix()}:{file_sha256(f)};".encode())
    return h.hexdigest()


def record_start(output_dir: str | Path, model, dataset: str = "") -> None:
    """On a run's start from scratch (no checkpoint yet): write start.json with the digest of the weights it starts
    from, the machine and, for a run on a local `dataset`, its resolved path and the digest of its contents. A start
    that never reached a checkpoint left nothing to continue, so its record is replaced, as record_config replaces
    its config; once the run has a checkpoint the record is kept."""
    from aisrl.bench.report import machine

    path = Path(output_dir) / "start.json"
    if path.exists() and _latest_name(output_dir) is not None:
        return
    record = {"weights": weights_digest(model.state_dict()), "machine": machine()}
    if dataset:
        record["dataset"] = {"path": str(Path(dataset).resolve()), "sha256": dataset_sha256(dataset)}
    atomic_write_text(path, json.dumps(record))


def same_dataset(run_dir: str | Path, dataset: str) -> bool:
    """Whether `dataset` holds the rows the run started on (its start.json's digest), wherever it lies now: True when
    it does, False when the run recorded none (no start.json, or one from before datasets were recorded). A file
    whose contents differ raises ValueError naming both: the run's held-out split and its prompts came from the
    rows it recorded, so continuing or scoring it on others would splice two experiments under one name."""
    path = Path(run_dir) / "start.json"
    recorded = read_record(path).get("dataset") if path.exists() else None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str):
        return False
    now = dataset_sha256(dataset)
    if now != recorded["sha256"]:
        what = "does not exist" if now == "missing" else f"holds other rows (sha256 {now[:12]}…)"
        raise ValueError(f"dataset={dataset!r} {what}, and {run_dir} was started on {recorded.get('path')!r} "
                         f"(sha256 {recorded['sha256'][:12]}…, start.json): the file was edited or replaced since, "
                         "so its prompts and held-out split are not the run's. Give the file the run trained on "
                         "with dataset=PATH (restore it if it was edited), or train the new rows in a new "
                         "output_dir")  # fmt: skip
    return True


def run_start(run_dir: str | Path) -> str | None:
    """The digest of a run's initial weights, or None for a run that predates start.json."""
    path = Path(run_dir) / "start.json"
    if not path.exists():
        return None
    record = read_record(path)
    if not isinstance(record.get("weights"), str):
        raise ValueError(f"{path} records no digest of the initial weights ('weights'); delete it if the run has "
                         "no checkpoint yet (it is written anew), else restore it from a copy")  # fmt: skip
    return record["weights"]


def same_start(a: str | Path, b: str | Path) -> bool:
    """False only when both runs recorded their initial weights and these differ."""
    sa, sb = run_start(a), run_start(b)
    return sa is None or sb is None or sa == sb


MAPPINGS = ("task_options", "correction.options")
"""Config fields that hold a mapping: compared whole, so an entry added or removed is a change."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        whole = not isinstance(v, dict) or f"{prefix}{k}" in MAPPINGS
        out.update({f"{prefix}{k}": v} if whole else _flat(v, f"{prefix}{k}."))
    return out


def _same_path(a, b) -> bool:
    """Two spellings of one local path (`d.jsonl` typed in its folder, the absolute path a run records)."""
    return isinstance(a, str) and isinstance(b, str) and bool(a and b) and Path(a).resolve() == Path(b).resolve()


def config_changes(recorded: dict, config: dict, free: tuple[str, ...] = RESUMABLE,
                   defaults: dict | None = None) -> list[str]:  # fmt: skip
    """'key: old -> new' for every dotted key whose value differs between two config dicts, except `free` ones.
    A key the record lacks (a field added by a later version, which keeps the earlier behaviour at its default)
    is a change only when `config` sets it away from its value in `defaults` (the config class's defaults)."""
    a, b = (_flat(json.loads(json.dumps(c))) for c in (recorded, config))  # tuples compare as the lists JSON keeps
    out = [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a.keys() & b.keys())
           if k not in free and a[k] != b[k] and not (k == "dataset" and _same_path(a[k], b[k]))]  # fmt: skip
    d = _flat(json.loads(json.dumps(defaults))) if defaults is not None else {}
    return out + [f"{k}: not recorded (the default {d[k]!r}) -> {b[k]!r}" for k in sorted(b.keys() - a.keys())
                  if k in d and k not in free and b[k] != d[k]]  # fmt: skip


def record_config(output_dir: str | Path, config: dict, write: bool = True, defaults: dict | None = None,
                  free: tuple[str, ...] = RESUMABLE) -> None:  # fmt: skip
    """Record `config` as the run's on its first start (`write`: this process may write it); on a later start,
    raise ValueError if it differs from the record in any key but `free` ones (RESUMABLE; `dataset` too when the
    file holds the rows the run started on: it moved), and record the new values of those. Every other key of the
    record stays as it was, including keys this version no longer has. A record without a checkpoint (a run that
    failed before its first save: an out-of-memory first step, say) holds no weights to continue, so a new start
    replaces it."""
    path = Path(output_dir) / "config.json"
    if not path.exists() or _latest_name(output_dir) is None:
        if write:
            atomic_write_text(path, json.dumps(config, indent=1))
        return
    recorded = read_record(path)
    changes = config_changes(recorded, config, free=free, defaults=defaults)
    if changes:
        raise ValueError(f"{output_dir} holds a run started with another config ({'; '.join(changes)}); resume "
                         f"with the same settings (`aisrl train {path}` reads them from the record), pick a new "
                         f"output_dir, or delete {path} to continue this run's weights under the new settings "
                         "(possible only where they fit the model these settings build)")  # fmt: skip
    moved = {k: config[k] for k in free if k in config and k in recorded and recorded[k] != config[k]}
    if moved and write:
        atomic_write_text(path, json.dumps({**recorded, **moved}, indent=1))


def hold_run(output_dir: str | Path):
    """An exclusive lock on the run folder for as long as the returned file stays open (None where the platform has
    no flock): a second trainer in one folder (a study started twice, a killed study's orphans) would interleave its
    rows and checkpoints with the first's."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    f = open(Path(output_dir) / ".lock", "a")  # noqa: SIM115 (held open by the caller: the lock lives with it)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"{output_dir} is being trained by another process (it holds {output_dir}/.lock): wait for it "
                         "to finish or stop it, then run this again to resume") from None
    return f


def _dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """The folder of a run's checkpoint at `step` (it holds model.safetensors and state.pt)."""
    return _dir(output_dir) / f"step_{step:06d}"


def saved_weights(output_dir: str | Path, step: int, resumable: bool = False) -> Path:
    """The model.safetensors of a run's checkpoint at `step`; a ValueError listing the saved steps if it has none
    (`resumable`: or if it lacks the state.pt that training on from it needs)."""
    path = checkpoint_dir(output_dir, step) / "model.safetensors"
    if not path.is_file() or (resumable and not (path.parent / "state.pt").is_file()):
        need = ("model.safetensors", "state.pt") if resumable else ("model.safetensors",)
        saved = sorted(int(p.name[5:]) for p in _dir(output_dir).glob("step_*")
                       if p.name[5:].isdigit() and all((p / f).is_file() for f in need))  # fmt: skip
        what = f"an incomplete checkpoint (it needs {' and '.join(need)})" if path.parent.is_dir() else "no checkpoint"
        raise ValueError(f"{output_dir} has {what} at step {step}; it holds complete ones at steps {saved}")
    return path


def save_checkpoint(output_dir, step: int, model, optimizer, extra: dict, keep: int = 2,
                    rank_rng: list[dict] | None = None) -> Path:  # fmt: skip
    """Write the checkpoint of `step` atomically and point `latest` at it, keeping `keep` checkpoints in all (0: all
    of them). `rank_rng`: every rank's generator states under torchrun (each rank draws its own dropout masks),
    restored by rank for an exact resume."""
    root = _dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(output_dir, step)
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}  # no GPU copy
    save_file(state, tmp / "model.safetensors")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if rank_rng is not None:
        rng["ranks"] = rank_rng
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
    others = sorted((p for p in root.glob("step_*") if p != final and p.name[5:].isdigit()),
                    key=lambda p: int(p.name[5:]))  # by step: past step 999999 the names grow a digit  # fmt: skip
    later = [p for p in others if int(p.name[5:]) > step]  # an abandoned start's (`latest` deleted, or moved back)
    earlier = [p for p in others if int(p.name[5:]) < step]
    stale = earlier[: max(len(earlier) - (keep - 1), 0)] if keep > 0 else []  # keep this one and keep - 1 before it
    left = list(root.glob(".tmp_step_*"))  # an earlier save cut short (a crash, a full disk) at a step not saved since
    for old in later + stale + left:  # (keep 0: every one)
        shutil.rmtree(old, ignore_errors=True)
    return final


def _latest_name(output_dir) -> str | None:
    """The checkpoint folder name `latest` points at (None when there is no pointer)."""
    pointer = _dir(output_dir) / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def latest_step(output_dir) -> int | None:
    """The step of the checkpoint `latest` names, read from its folder name (None when there is none)."""
    name = _latest_name(output_dir)
    return int(name[5:]) if name and name.startswith("step_") and name[5:].isdigit() else None


def latest_checkpoint(output_dir) -> Path | None:
    name = _latest_name(output_dir)
    if name is None:
        return None
    pointer, path = _dir(output_dir) / "latest", _dir(output_dir) / name
    if not _complete(path):
        whole = sorted((p for p in _dir(output_dir).glob("step_*") if p.name[5:].isdigit() and _complete(p)),
                       key=lambda p: int(p.name[5:]))  # fmt: skip
        # deleting `latest` starts over, and the new start's first save removes every later step_* as abandoned
        fix = (f"resume from the newest complete checkpoint by writing {whole[-1].name} into {pointer}" if whole
               else f"delete {pointer} to start over (no complete checkpoint is left)")  # fmt: skip
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing; restore it, or {fix}")
    return path


def _complete(path: Path) -> bool:
    """Whether a checkpoint folder holds both of its files."""
    return (path / "state.pt").exists() and (path / "model.safetensors").exists()


def _unreadable(path: Path, e: Exception) -> ValueError:
    """The error for a checkpoint file that exists but does not load (cut short by a partial copy, a disk fault)."""
    return ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); it is damaged or cut short. Restore it from a "
                      f"copy, or resume from an earlier checkpoint by writing its folder name (step_NNNNNN) into "
                      f"{path.parent.parent / 'latest'}")  # fmt: skip


class OtherModelError(ValueError):
    """A checkpoint holds the tensors of another model than the one the config builds (missing, unexpected or
    mis-shaped ones)."""


def load_weights(model, weights: Path) -> None:
    """Load a checkpoint's model.safetensors into `model`; a ValueError naming the settings to check when it holds
    another model's tensors (missing, unexpected or mis-shaped ones), or saying that the file is damaged."""
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise _unreadable(weights, e) from e
    try:
        model.load_state_dict(tensors)
    except RuntimeError as e:
        lines = str(e).strip().splitlines()
        what = (lines[1] if len(lines) > 1 else lines[0]).strip()
        what = what if len(what) <= 200 else what[:200] + "..."
        raise OtherModelError(f"{weights.parent} holds weights of another model than this config builds ({what}): "
                              "the model.*, lora.* or lab.* settings differ from the run's; pass the run's settings "
                              "(or, when resuming, pick a new output_dir)") from e  # fmt: skip


def load_checkpoint(path: Path, model, optimizer, rank: int = 0) -> dict:
    """Restore model, optimizer and RNG state (this rank's, where every rank's was saved); returns {'step': ...,
    'extra': ...}."""
    load_weights(model, path / "model.safetensors")
    try:  # on the CPU: the optimizer moves its state to its parameters
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:  # ValueError: damaged text
        raise _unreadable(path / "state.pt", e) from e
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available() and len(state["rng"]["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])  # a run resumed on another GPU count keeps the CPU RNG only
    ranks = state["rng"].get("ranks") or []
    if rank < len(ranks):  # the same number of processes as when saved, or more: this rank's own generators
        torch.set_rng_state(ranks[rank]["torch"])
        if "cuda" in ranks[rank] and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(ranks[rank]["cuda"])  # this rank's device
    return {"step": state["step"], "extra": state["extra"]}
