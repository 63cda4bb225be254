import re

import pytest

from nested_jax import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command_is_rejected(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_unknown_bench_is_rejected(capsys):
    assert cli.main(["bench", "nope"]) == 2


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(capsys, flag):
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out
    assert out == f"nested-jax {cli.version()}\n"
    assert re.fullmatch(r"\d+\.\d+\S*", cli.version())


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    from importlib import metadata

    import nested_jax

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == nested_jax.__version__


@pytest.mark.parametrize("name", cli.BENCHES)
def test_every_bench_help_names_its_command(capsys, name):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", name, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: nested-jax bench {name} ")
