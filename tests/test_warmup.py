"""dispatch.warmup and `mxmla warmup`: one query-path + attention step at a given shape, bad shapes
named; tiny shapes on the CPU (torch backend)."""
import pytest

from dispatch import cli, warmup


@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_warmup_runs_both_paths(path):
    assert warmup.mla_block(64, batch=2, heads=2, q_lora=64, path=path, backend="torch", device="cpu") > 0


@pytest.mark.parametrize("kw, name", [(dict(tokens=0), "tokens"), (dict(heads=1.5), "heads"),
                                      (dict(batch=True), "batch"), (dict(path="fp8"), "path")])
def test_warmup_bad_arguments_named(kw, name):
    kw = dict(dict(tokens=64, heads=2, q_lora=64, device="cpu", backend="torch"), **kw)
    with pytest.raises(ValueError, match=name):
        warmup.mla_block(**kw)


def test_cli_warmup(capsys):
    assert cli.main(["warmup", "--seq", "64", "--heads", "2", "--q-lora", "64", "--backend", "torch",
                     "--device", "cpu"]) == 0
    assert "B1 S64 H2" in capsys.readouterr().out
    assert cli.main(["warmup", "--seq", "0", "--device", "cpu"]) == 2
    assert "tokens" in capsys.readouterr().err
