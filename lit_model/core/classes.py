"""A module's class swapped for a subclass that mixes behaviour in (LoRA's adapters, the parallel levers' wrappers),
as ``fully_shard`` does: parameter names and state dicts stay those of the module."""

from __future__ import annotations

from typing import Optional

_MIXED: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, base: type, name: Optional[str] = None) -> type:
    """The class ``(mixin, base)``, made once per pair: every module swapped to it shares one class (isinstance checks,
    torch.compile's guards). ``name``: its name (default: the mixin's, less leading underscores, then the base's)."""
    if (mixin, base) not in _MIXED:
        name = name or f"{mixin.__name__.lstrip('_')}{base.__name__}"
        _MIXED[mixin, base] = type(name, (mixin, base), {"__module__": mixin.__module__})
    return _MIXED[mixin, base]
