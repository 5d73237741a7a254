"""mxmla's custom ops in torch.compile's on-disk caches.

AOTAutograd's and Inductor's cache keys hash the traced graph, which names a custom op but holds none of
its Python: the autograd rule that AOTAutograd traces into the backward graph and the fake rule are not in
the key. A graph cached by an earlier mxmla would then be reused after an upgrade that changed a rule,
calling ops with an old signature or computing an old backward. `tag()` adds a digest of the files that
define mxmla's custom ops and their rules to `torch.compiler.config.cache_key_tag` (which both caches
hash), once, at import: a changed rule misses the cache and compiles afresh; a user's own tag is kept in
front of it.
"""
from __future__ import annotations

import hashlib
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# every module that registers a custom op, a fake rule or an autograd rule
RULE_FILES = ("autograd.py", "q_path.py", "weights.py", os.path.join("integrations", "torchtitan.py"))


def digest() -> str:
    """Short digest of RULE_FILES' bytes."""
    h = hashlib.sha256()
    for name in RULE_FILES:
        try:
            with open(os.path.join(_HERE, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
        except OSError:  # an install without sources: the name alone (the version is then the key's)
            h.update(name.encode() + b"\0?")
    return h.hexdigest()[:16]


def tag() -> str:
    """Add "mxmla-<digest>" to torch.compiler.config.cache_key_tag (once); returns the tag in force ("" on
    a torch without that setting, whose caches then key as they do)."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return ""
    mine = f"mxmla-{digest()}"
    current = config.cache_key_tag or ""
    if mine not in current.split("+"):
        config.cache_key_tag = f"{current}+{mine}" if current else mine
    return config.cache_key_tag
