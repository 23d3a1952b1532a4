"""Sparsity: which FFN neurons a token needs, and what it takes to know.

Owns the sources (one class per file: oracle.py, threshold.py, predictor.py,
dip.py), their registry, and calibration (calibrate.py: records activations,
trains the predictors, measures Req_i; allocation.py: the per-layer thresholds
of both FFN sides; recovery.py: the calibrated sources' adapters). A source is found by its `name`: every module of this
package except base / calibrate / allocation / recovery is scanned for Source
subclasses, so adding a source is adding its file (and its tests): the CLI's
--sparsity choices, the errors for what a model lacks, and the benchmarks'
source lists all come from `sources()`.

May import: errors, layout, models.ffn (calibrate: the loader, lazily). Never
the runtime: the runtime asks this package for a source by name.
"""

import importlib
import pkgutil

from ..errors import FlashError
from .base import Source, SourceContext, top_k_mask  # noqa: F401

_NOT_SOURCES = ("base", "calibrate", "allocation", "recovery")
_registry = None


def sources():
    """{name: Source subclass}, every source this package has."""
    global _registry
    if _registry is None:
        found = {}
        for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if m.name.startswith("_") or m.name in _NOT_SOURCES:
                continue
            mod = importlib.import_module(f"{__name__}.{m.name}")
            for obj in vars(mod).values():
                if (isinstance(obj, type) and issubclass(obj, Source) and obj.name
                        and obj.__module__ == mod.__name__):
                    found[obj.name] = obj
        _registry = found
    return _registry


def source_names():
    return tuple(sources())


def source_class(name):
    if name not in sources():
        raise FlashError(f"unknown sparsity source '{name}' (available: {', '.join(sources())})")
    return sources()[name]

