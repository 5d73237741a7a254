"""Every environment switch of mxmla, parsed here and nowhere else.

Each switch has one parser: a 0 / 1 flag, or one word of a fixed list. Unset or empty means the
default; any other value raises `ValueError` naming the variable and the accepted values (a typo such
as `MXMLA_TRITON_AUTOTUNE=yes` is never read as "off"). Values are read from the environment each time
a reader asks, so a change takes effect on the next call that reads it.

`check_all()` parses every switch at once. The dispatcher calls it whenever it selects a backend
(the first call of each call signature, and after `dispatch.clear_cache()`), so a bad value raises
even when no kernel on this machine reads that switch (on CPU the Triton GPU paths never do).

MXMLA_BACKEND has a grammar of its own (per-op backend lists); its parser is
`dispatch.policy.parse_policy`, and it is listed here so that one table holds every switch, as is
MXMLA_CACHE_DIR (a directory, read by backends/cudnn/plan_cache.py). The table
in docs/ARCHITECTURE.md ("Environment switches") is this module's `SWITCHES`, one row each.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

FLAG = ("0", "1")


@dataclass(frozen=True)
class Switch:
    name: str
    values: Optional[Tuple[str, ...]]  # accepted words; None: a grammar parsed elsewhere
    default: str
    read_by: str
    meaning: str
    values_text: str = "grammar"  # the table's 'values' cell of a switch without a word list


SWITCHES: Dict[str, Switch] = {s.name: s for s in (
    Switch("MXMLA_BACKEND", None, "auto", "dispatch (grammar: dispatch/policy.py)",
           "which backend serves each op; docs/ARCHITECTURE.md, 'Selection grammar'"),
    Switch("MXMLA_BACKGROUND_LOAD", FLAG, "1", "dispatch (at import)",
           "1: importing dispatch starts one daemon thread that, on a machine with a CUDA device, imports the "
           "backends (Triton, the cuDNN frontend, their kernel modules) and computes Triton's compiler "
           "fingerprint, while the caller builds its model; the first op then waits only for what is left. "
           "0: all of it happens in the first op"),
    Switch("MXMLA_CHECK_VALUES", FLAG, "0", "dispatch",
           "1: check index-tensor values (cu_seqlens, positions, start_positions) of CUDA calls too; each "
           "check copies them to the host, a device synchronisation per call. CPU calls are always checked"),
    Switch("MXMLA_CACHE_DIR", None, "~/.cache/mxmla", "cudnn: plan_cache",
           "the root of mxmla's on-disk caches (cuDNN plans in its cudnn/ folder); unset: "
           "$XDG_CACHE_HOME/mxmla, else ~/.cache/mxmla", values_text="a directory"),
    Switch("MXMLA_CUDNN_PLAN_CACHE", FLAG, "1", "cudnn: plan_cache (attention graphs)",
           "1: built cuDNN graphs' plans are written to the cache directory and later processes load them "
           "instead of building (hundreds of milliseconds per graph); 0: every process builds its graphs"),
    Switch("MXMLA_TRITON_AUTOTUNE", FLAG, "0", "triton: gemm, mla_q, attention, quantize, rmsnorm, rope",
           "0: no timing runs: each kernel launches a heuristic tile, a function of its shape class "
           "(backends/triton/tile_choice.py), or the tile recorded for this GPU model at that key; 1: autotune "
           "tiles per shape bucket (timing runs at the first call of each bucket the recorded table lacks)"),
    Switch("MXMLA_TRITON_PRETUNED", FLAG, "1", "triton: pretuned.py (every autotuned kernel but the gemm's)",
           "1: the tile choices recorded for this GPU model (backends/triton/pretuned/) replace the heuristic's "
           "at their keys, and with autotuning on spare their timing runs; 0: tables ignored"),
    Switch("MXMLA_TRITON_BACKGROUND_COMPILE", FLAG, "1", "triton: _common.launch_gated (gemm, mla_q)",
           "1: an exact fallback kernel (gated on a device-side guard) compiles in a background thread at its "
           "first call, which meanwhile reads the guard on the host (one synchronisation) and compiles and runs "
           "the fallback only if it is raised; 0: compiled at its first launch"),
    Switch("MXMLA_TRITON_COMPILE_AHEAD", FLAG, "1", "triton: compile_ahead (through _common.fast_launch)",
           "1: the first launch that only one path's recorded workloads make (backends/triton/pretuned/<arch>.compile.json, "
           "e.g. sm90; matched by what Triton specializes on, any shape) compiles every kernel recorded on that path on "
           "background threads; 0: each kernel compiles at its first launch"),
    Switch("MXMLA_TRITON_FAST_LAUNCH", FLAG, "1",
           "triton: _common.fast_launch (quantize, dequantize, rmsnorm forward and backward, mla_kv, rope, the Gluon mla_q forward, gated fallbacks)",
           "1: a repeated launch (same kernel, device, argument values and pointer alignment) calls the "
           "compiled kernel directly, skipping the autotuner's and Triton's per-launch argument handling; "
           "0: every launch through Triton's own path"),
    Switch("MXMLA_TRITON_FP8_MMA", FLAG, "0", "triton: _mxfp8.fp8_mma_widened (gemm, mla_q)",
           "1: MXFP8 block dots on the fp8 MMA (faster on sm90, narrower accumulator than fp32); "
           "0: codes widened to fp16 first"),
    Switch("MXMLA_TRITON_WEIGHT_BF16", FLAG, "0", "triton: mla_q._weight_bf16 (the MXFP8 projection on sm90)",
           "1: the fused op's MXFP8 weight is dequantized to bf16 once per weight MXTensor and the copy kept while "
           "those codes live (2 bytes an element; the forward's row copy and the backward's column copy one each): "
           "for a weight that serves several calls per update (gradient accumulation, inference); 0: dequantized "
           "on every call (a weight re-quantized every step gains nothing from the copies)"),
    Switch("MXMLA_TRITON_SOFT_FP8", FLAG, "0", "triton: _mx_codec.use_hw_cvt (quantize, rmsnorm, mla_kv)",
           "1: fp8 and bf16 conversions on the bits instead of the hardware cvt (for A/B checks)"),
)}

# Switches that were removed: kernel variants are named in MXMLA_BACKEND's grammar now. Setting one
# raises (at the next selection) with the replacement, instead of being ignored.
REMOVED = {
    "MXMLA_TRITON_GEMM_VARIANT": "name the variant in MXMLA_BACKEND, e.g. MXMLA_BACKEND='mxfp8_gemm=triton:bf16'",
    "MXMLA_TRITON_MLA_Q_VARIANT": "name the variant in MXMLA_BACKEND, e.g. "
                                  "MXMLA_BACKEND='mla_q_uproj_rope_quant=triton:gluon_ws128'",
}

# Not mxmla's own: Triton reads it (1 / true / on, any case, as Triton's getenv_bool does); mxmla's
# capability checks read it the same way to know that kernels run on the CPU.
TRITON_INTERPRET = "TRITON_INTERPRET"
_TRUE_WORDS = ("1", "true", "on")


# Kernel launchers read several switches per call, and os.environ.get encodes the key and decodes the
# value each time (about a microsecond). On POSIX os.environ keeps its raw bytes in a dict that every
# assignment through os.environ updates, so the readers look there with each name encoded once.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENCODED: Dict[str, bytes] = {}


def _raw(name: str) -> str:
    key = _ENCODED.get(name)
    if key is None:
        if os.name != "posix" or not isinstance(_ENV_DATA, dict):  # pragma: no cover - other platforms
            return os.environ.get(name, "")
        key = _ENCODED[name] = os.fsencode(name)
    value = _ENV_DATA.get(key)
    return "" if value is None else os.fsdecode(value)


def choice(name: str, choices: Optional[Tuple[str, ...]] = None, default: Optional[str] = None) -> str:
    """The switch's word (unset or empty: its default). `choices` / `default` narrow or stand in for the
    table's (for a switch a module declares on its own); any other value raises naming the variable."""
    sw = SWITCHES.get(name)
    allowed = choices if choices is not None else (sw.values if sw else None)
    if allowed is None:
        raise KeyError(f"{name}: not a word-valued switch of backends/settings.py")
    value = _raw(name) or (default if default is not None else sw.default)
    if value not in allowed:
        raise ValueError(f"environment variable {name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def flag(name: str, default: Optional[bool] = None) -> bool:
    """A 0 / 1 switch (unset or empty: `default`, else the table's default); anything else raises."""
    value = _raw(name)
    if value == "":
        if default is not None:
            return default
        return SWITCHES[name].default == "1"
    if value not in FLAG:
        raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")
    return value == "1"


def text(name: str) -> str:
    """A switch without a word list, as set ("" when unset); its reader gives it meaning."""
    if SWITCHES[name].values is not None:
        raise KeyError(f"{name}: a word-valued switch; read it with choice() or flag()")
    return _raw(name)


def cache_dir() -> str:
    """The root of mxmla's on-disk caches: MXMLA_CACHE_DIR, else $XDG_CACHE_HOME/mxmla, else
    ~/.cache/mxmla."""
    return text("MXMLA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mxmla")


def interpret_mode() -> bool:
    """Triton's interpreter is on (kernels run on the CPU, in NumPy)."""
    return _raw(TRITON_INTERPRET).lower() in _TRUE_WORDS


def check_all() -> None:
    """Parse every word- and flag-valued switch; the first bad one (or a removed one that is set)
    raises, naming the variable."""
    for name, instead in REMOVED.items():
        if _raw(name):
            raise ValueError(f"environment variable {name} was removed: {instead}")
    for sw in SWITCHES.values():
        if sw.values is not None:
            choice(sw.name)


def markdown_table() -> str:
    """The table docs/ARCHITECTURE.md carries (tests compare them)."""
    rows = ["| variable | values | default | read by | meaning |", "|---|---|---|---|---|"]
    for sw in SWITCHES.values():
        values = " \\| ".join(f"`{v}`" for v in sw.values) if sw.values else sw.values_text
        rows.append(f"| `{sw.name}` | {values} | `{sw.default}` | {sw.read_by} | {sw.meaning} |")
    return "\n".join(rows)
