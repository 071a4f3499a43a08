"""Adapters that run aisrl's corrections inside other trainers (TRL, verl); each imports its trainer lazily."""


def import_error(e: ImportError, package: str, fix: str, supported: str) -> ImportError:
    """The error for an adapter whose trainer did not import: not installed (`fix` says how to install it), installed
    in a version without what the adapter imports (a module or name of `package` missing: `supported` names the
    versions that have it), or installed but broken (an import of one of its dependencies failed), which
    reinstalling the adapter's extra would not fix, so the failing import is named."""
    name = getattr(e, "name", None) or ""
    if isinstance(e, ModuleNotFoundError) and name == package:
        return ImportError(fix)
    if name.split(".")[0] == package:  # verl.trainer.ppo missing, or `cannot import name 'GRPOTrainer' from 'trl'`
        return ImportError(f"{package} is installed, but a version without what aisrl uses ({type(e).__name__}: {e}); "
                           f"aisrl needs {supported}: pip install -U '{supported}'")  # fmt: skip
    return ImportError(f"{package} is installed but does not import ({type(e).__name__}: {e}); one of its "
                       f"dependencies is missing or of a version it does not support: check `pip check`, or "
                       f"reinstall {package} with the versions it pins")  # fmt: skip
