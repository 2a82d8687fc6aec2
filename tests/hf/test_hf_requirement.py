"""pipetrain.hf refuses a ``transformers`` older than the one its wrappers are written against
(the ``hf`` extra's floor), naming the version found and the command that fixes it — at the
library's entry points and before ``pipetrain train`` starts a process — instead of failing
somewhere inside a layer."""

from __future__ import annotations

from importlib import metadata

import pytest

pytest.importorskip("torch")

from pipetrain.app.train_checks import check_arguments
from pipetrain.cli.train_command import config_from_argv
from pipetrain.hf import causal_lm, from_pretrained
from pipetrain.hf.causal_lm import MIN_TRANSFORMERS, transformers_problem

FLOOR = ".".join(map(str, MIN_TRANSFORMERS))


def installed(monkeypatch, version: str | None) -> None:
    def fake(name: str) -> str:
        if name != "transformers":
            return real(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    real = metadata.version
    monkeypatch.setattr(metadata, "version", fake)


def test_an_older_transformers_is_refused_naming_both_versions(monkeypatch, tmp_path) -> None:
    installed(monkeypatch, "5.17.0")
    said = f"needs transformers >= {FLOOR}; this environment has 5.17.0"
    assert said in (transformers_problem() or "")
    with pytest.raises(ImportError, match=said):
        causal_lm.causal_lm_layers(object())
    with pytest.raises(ImportError, match=said):
        from_pretrained(tmp_path / "no-such-folder", [1])
    with pytest.raises(ValueError, match=f"--model llama: pipetrain.hf {said}"):
        check_arguments(config_from_argv(["--model", "llama"]))


@pytest.mark.parametrize("version", [FLOOR + ".0", "5.30.0.dev0", "6.0.0"])
def test_the_floor_and_newer_pass(monkeypatch, version) -> None:
    installed(monkeypatch, version)
    assert transformers_problem() is None


def test_no_transformers_names_the_extra(monkeypatch) -> None:
    installed(monkeypatch, None)
    assert transformers_problem() == (
        f"pipetrain.hf needs transformers >= {FLOOR}: pip install 'pipetrain[hf]'"
    )
