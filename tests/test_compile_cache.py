"""dispatch.compile_cache: torch.compile's cache keys carry a digest of mxmla's custom-op rules."""
import shutil

import torch

from dispatch import compile_cache


def test_importing_the_ops_tags_the_cache_key_once():
    import dispatch.autograd  # noqa: F401  (registers the ops and tags)

    mine = f"mxmla-{compile_cache.digest()}"
    assert mine in torch.compiler.config.cache_key_tag.split("+")
    with torch.compiler.config.patch(cache_key_tag=mine):
        assert compile_cache.tag() == mine  # not added twice


def test_a_users_own_tag_is_kept_in_front():
    with torch.compiler.config.patch(cache_key_tag="my-run"):
        assert compile_cache.tag() == f"my-run+mxmla-{compile_cache.digest()}"


def test_the_digest_follows_every_rule_file(tmp_path, monkeypatch):
    import os

    src = os.path.dirname(compile_cache.__file__)
    for name in compile_cache.RULE_FILES:
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(src, name), tmp_path / name)
    monkeypatch.setattr(compile_cache, "_HERE", str(tmp_path))
    base = compile_cache.digest()
    assert base == compile_cache.digest()
    for name in compile_cache.RULE_FILES:
        with open(tmp_path / name, "ab") as f:
            f.write(b"\n# changed\n")
        changed = compile_cache.digest()
        assert changed != base, name
        base = changed


def test_a_torch_without_the_setting_is_left_alone(monkeypatch):
    class Bare:
        pass

    monkeypatch.setattr(torch.compiler, "config", Bare(), raising=False)
    assert compile_cache.tag() == ""
