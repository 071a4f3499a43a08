"""Adapters that run aisrl's corrections inside other trainers (TRL, verl); each imports its trainer lazily."""


def import_error(e: ImportError, package: str, fix: str) -> ImportError:
    """The error for an adapter whose trainer did not import: not installed (`fix` says how to install it), or
    installed but broken (one of its own imports failed: a dependency of another version, say), which reinstalling
    the adapter's extra would not fix, so the failing import is named."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == package:
        return ImportError(fix)
    return ImportError(f"{package} is installed but does not import ({type(e).__name__}: {e}); one of its "
                       f"dependencies is missing or of a version it does not support: check `pip check`, or "
                       f"reinstall {package} with the versions it pins")  # fmt: skip
