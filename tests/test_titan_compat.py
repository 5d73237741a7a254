"""tests/titan_compat.py: stand-ins for torch >= 2.12 names that TorchTitan 0.3.0 imports, installed only
on a torch that lacks them, and refusing any use."""
from __future__ import annotations

import importlib

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("needs torch.distributed (the stood-in names live in torch.distributed.fsdp)",
                allow_module_level=True)

from tests import titan_compat  # noqa: E402


def test_installs_nothing_on_a_torch_that_has_the_names():
    stood_in = titan_compat.install()
    if stood_in:
        pytest.skip(f"torch {torch.__version__} lacks {', '.join(stood_in)}: the stand-ins are in use here")
    assert titan_compat.missing() == []
    for module, name, stand_in, _ in titan_compat.STAND_INS:
        assert getattr(importlib.import_module(module), name) is not stand_in, f"{module}.{name}"


def test_installs_each_missing_name_once_and_only_those():
    stood_in = titan_compat.install()
    if not stood_in:
        pytest.skip(f"torch {torch.__version__} has every name tests/titan_compat.py knows of: nothing stood in")
    assert titan_compat.install() == stood_in  # a second call adds nothing
    for module, name, stand_in, _ in titan_compat.STAND_INS:
        if f"{module}.{name}" in stood_in:
            assert getattr(importlib.import_module(module), name) is stand_in


@pytest.mark.parametrize("entry", titan_compat.STAND_INS, ids=lambda e: f"{e[0]}.{e[1]}")
def test_a_stand_in_raises_when_used_naming_itself(entry):
    module, name, stand_in, _ = entry
    with pytest.raises(NotImplementedError, match=rf"{module}\.{name} is a stand-in .*torch >= 2\.12"):
        stand_in(shard=(0,), replicate=None)
