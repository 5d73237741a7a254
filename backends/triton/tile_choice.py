"""How an autotuned Triton kernel picks its launch config: a heuristic, a recorded table, or timing.

Every autotuned kernel is made by `tuned(configs=, key=, heuristic=)`: Triton's autotuner over `configs`
with `key`, plus a heuristic, heuristic(configs, named arguments of the launch) -> one of `configs`
(so that every route compiles variants of the one list). What a launch runs:

- by default (MXMLA_TRITON_AUTOTUNE=0): no config is timed. Per autotuning key (Triton's: the key
  arguments' values, then the tensor arguments' dtypes) the choice is the table's recorded for this GPU
  model (pretuned.py, MXMLA_TRITON_PRETUNED=1) where it holds that key, else the heuristic's; it is
  made once per key and kept. A heuristic reads only the key's values (shape buckets, flags) and
  device facts, so that every shape of a key gets the choice its first shape got.
- MXMLA_TRITON_AUTOTUNE=1: Triton's autotuner times the configs at every key the table lacks (the
  table's choices fill its cache at its first launch).

Every config of an autotuner computes the same result, so the route never changes what a kernel
returns, only its speed. Like Liger's kernels (a block size from the row width, warps from the
block), the heuristics name a tile from the shape class, so a first call on any GPU and any shape
compiles one variant per kernel and times nothing.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional

import triton

from .. import settings
from . import pretuned

Heuristic = Callable[[list, Dict[str, Any]], "triton.Config"]


def autotune_requested() -> bool:
    """MXMLA_TRITON_AUTOTUNE: time the configs per key (1) or take the heuristic / table (0, default)."""
    return settings.flag("MXMLA_TRITON_AUTOTUNE")


def triton_key(tuner, named: Dict[str, Any]) -> tuple:
    """The autotuner's key of a launch, as Triton's Autotuner.run computes it (and the tables store
    it): the key arguments' values in key order, then every argument's dtype in argument order."""
    args = {k: v for k, v in named.items() if k in tuner.arg_names}
    key = [args[k] for k in tuner.keys if k in args]
    key.extend(str(v.dtype) for v in args.values() if hasattr(v, "dtype"))
    return tuple(key)


class _Chooser:
    """Replaces one autotuner's run (an instance attribute: Triton's launch calls self.run)."""

    def __init__(self, name: str, tuner, heuristic: Heuristic):
        self.name, self.tuner, self.heuristic = name, tuner, heuristic
        self.autotune_run = tuner.run  # Triton's own run, bound to the tuner
        self.chosen: Dict[tuple, Any] = {}  # key -> Config, made without timing
        self.recorded: Optional[Dict[tuple, Any]] = None  # the table's choices for this tuner
        self.prefilled = False
        tuner.run = self.run
        tuner.choose_config = self.choose  # tests and tools: the config a launch would take

    def choose(self, named: Dict[str, Any]):
        """The config a launch with these named arguments takes without timing (kept per key)."""
        key = triton_key(self.tuner, named)
        config = self.chosen.get(key)
        if config is None:
            if self.recorded is None:
                self.recorded = pretuned.recorded(self.name, self.tuner)
            config = self.recorded.get(key)
            if config is None:
                config = self.heuristic(self.tuner.configs, named)
                if not any(config is c for c in self.tuner.configs):
                    raise TypeError(f"{self.name}: its heuristic returned {config!r}, not one of its configs")
            self.chosen[key] = config
        return config

    def run(self, *args, **kwargs):
        tuner = self.tuner
        if autotune_requested():
            if not self.prefilled:
                self.prefilled = True
                pretuned.prefill(self.name, tuner)
            return self.autotune_run(*args, **kwargs)
        named = dict(zip(tuner.arg_names, args))
        named.update(kwargs)
        config = self.choose(named)
        tuner.best_config = config  # what Triton's run leaves, for fast_launch's resolution
        if config.pre_hook is not None:
            config.pre_hook({**named, **config.all_kwargs()})
        return tuner.fn.run(*args, **kwargs, **config.all_kwargs())


def tuned(*, configs, key, heuristic: Heuristic, **kwargs):
    """triton.autotune(configs=..., key=..., **kwargs) choosing as the module docstring says. Timing
    results, when autotuning is asked for, are kept on disk beside Triton's compiled kernels
    (cache_results, where this Triton has it): a second process with the same cache skips them."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("cache_results", True)
    decorate = triton.autotune(configs=configs, key=key, **kwargs)

    def make(fn):
        tuner = decorate(fn)
        _Chooser(pretuned.register(tuner), tuner, heuristic)
        return tuner

    return make


def first_config(configs, named):
    """The heuristic of a kernel whose list leads with the tile that serves every shape."""
    return configs[0]


def pick(configs, **wanted):
    """The config of `configs` whose meta-parameters and options equal `wanted` (e.g. BM=32, BN=128,
    num_warps=1); a heuristic names its choice this way so that it is always one of the list's."""
    for c in configs:
        kw = c.all_kwargs()
        if all(kw.get(k) == v for k, v in wanted.items()):
            return c
    raise LookupError(f"no config with {wanted}")
