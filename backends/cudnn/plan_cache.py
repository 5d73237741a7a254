"""Built cuDNN graphs kept on disk, so that a later process loads a graph's plan instead of building it.

Building an SDPA graph (heuristics, then the runtime compilation of its kernel) costs hundreds of
milliseconds per graph, which every new process pays on its first attention call. The frontend
serializes a built graph's selected plan (`pygraph.serialize`; runtime-compiled engines, which the
SDPA graphs are) and loads it into an empty graph (`pygraph.deserialize(handle, data)`), skipping
both steps.

One file per graph, `<directory>/<sha256>.plan`, named by the hash of the graph's cache key and the
fingerprint below; it holds a header (format, key, fingerprint, the graph's operand uids, its
workspace size) and the frontend's bytes. Files are written to a temporary name and renamed, so a
concurrent process never reads half a file. A file is used only when its header repeats the key
and the fingerprint exactly; one that fails to load (another cuDNN wrote it, it is damaged) is
reported once per process at INFO on the `mxmla.cudnn` logger and built over.

The fingerprint is what a plan depends on beyond the graph: this file format's version, the cuDNN
library and frontend versions, and the GPU's name, compute capability and multiprocessor count.

A plan holds compiled GPU code that the frontend loads, so the directory is made readable and
writable by its owner only (as Triton's kernel cache is). Switches: MXMLA_CUDNN_PLAN_CACHE=0 turns
the cache off (every process builds); MXMLA_CACHE_DIR names the root directory (default
$XDG_CACHE_HOME/mxmla, else ~/.cache/mxmla); plans go to its `cudnn/` folder.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from typing import Any, Optional, Sequence, Tuple

from .. import settings
from . import _common

log = logging.getLogger("mxmla.cudnn")

FORMAT = 1
MAGIC = b"MXMLA_CUDNN_PLAN\n"
_LEN = struct.Struct("<I")

loaded_count = 0  # graphs loaded from disk in this process (tests and the benchmark read it)
stored_count = 0  # graphs written
_reported: set = set()  # (kind of failure, path) already logged


def enabled() -> bool:
    return settings.flag("MXMLA_CUDNN_PLAN_CACHE")


def usable(device_index: Any) -> bool:
    """The cache is on and the graph is for a CUDA device (an index >= 0; CPU tensors give -1)."""
    return enabled() and isinstance(device_index, int) and device_index >= 0


def directory() -> str:
    """Where plans live: $MXMLA_CACHE_DIR/cudnn, else $XDG_CACHE_HOME/mxmla/cudnn, else ~/.cache/mxmla/cudnn."""
    return os.path.join(settings.cache_dir(), "cudnn")


def fingerprint(device_index: int) -> str:
    """What a plan depends on beyond its graph (module docstring), as one string."""
    import torch  # noqa: PLC0415 - the backend's callers have it; kept local for the CPU tests' fakes

    fe = _common.frontend()
    props = torch.cuda.get_device_properties(device_index)
    return json.dumps({
        "format": FORMAT,
        "cudnn": _common.backend_version(),
        "frontend": getattr(fe, "__version__", None),
        "gpu": props.name,
        "capability": [props.major, props.minor],
        "sms": props.multi_processor_count,
    }, sort_keys=True)


def _path(key_text: str, print_: str) -> str:
    digest = hashlib.sha256((key_text + "\n" + print_).encode()).hexdigest()
    return os.path.join(directory(), digest + ".plan")


def _report(kind: str, path: str, exc: BaseException) -> None:
    if (kind, path) not in _reported:
        _reported.add((kind, path))
        log.info("cuDNN plan cache: %s %s failed (%s: %s); building the graph instead", kind, path,
                 type(exc).__name__, exc)


def load(key: tuple, device_index: int, handle) -> Optional[Tuple[Any, Tuple[int, ...], int]]:
    """(graph, operand uids, workspace bytes) of the plan kept for `key`, or None (no file, a file for
    another key or machine, or one the frontend refuses)."""
    global loaded_count
    try:
        key_text, print_ = repr(key), fingerprint(device_index)
    except Exception as exc:  # noqa: BLE001 - the machine cannot be described: no cache
        _report("describing the device for", directory(), exc)
        return None
    path = _path(key_text, print_)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        if not raw.startswith(MAGIC):
            raise ValueError("not a plan file")
        start = len(MAGIC) + _LEN.size
        (n,) = _LEN.unpack_from(raw, len(MAGIC))
        header = json.loads(raw[start:start + n].decode())
        if header.get("format") != FORMAT or header.get("key") != key_text or header.get("fingerprint") != print_:
            raise ValueError("header names another graph or machine")
        graph = _common.frontend().pygraph(handle=handle)
        graph.deserialize(handle, raw[start + n:])
        workspace = int(graph.get_workspace_size())
    except Exception as exc:  # noqa: BLE001 - any failure to load means: build it
        _report("loading", path, exc)
        return None
    loaded_count += 1
    return graph, tuple(int(u) for u in header["uids"]), workspace


def store(key: tuple, device_index: int, graph, uids: Sequence[int], workspace: int) -> bool:
    """Write the built graph's plan for `key`; False (and nothing written) when the frontend cannot
    serialize it or the directory is not writable."""
    global stored_count
    path = directory()
    try:
        key_text, print_ = repr(key), fingerprint(device_index)
        path = _path(key_text, print_)
        blob = bytes(graph.serialize(as_bytes=True))
        header = json.dumps({"format": FORMAT, "key": key_text, "fingerprint": print_,
                             "uids": [int(u) for u in uids], "workspace": int(workspace)}).encode()
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header + blob)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as exc:  # noqa: BLE001 - a plan that cannot be kept is built again next time
        _report("storing", path, exc)
        return False
    stored_count += 1
    return True
