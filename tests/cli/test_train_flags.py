"""``pipetrain train``'s command line: flags read from ``--config FILE.toml`` under the command
line's, bad files refused naming the key (exit 2), no flag taken from a prefix of another, and
``--data`` with ``--text`` as its alias."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.cli.commands import main
from pipetrain.cli.train_command import config_from_argv


@pytest.fixture
def launched(monkeypatch) -> list:
    """The configs ``pipetrain train`` would launch (nothing is launched)."""
    pytest.importorskip("torch")
    import pipetrain.app.launch

    configs: list = []
    monkeypatch.setattr(pipetrain.app.launch, "run_train", lambda c: configs.append(c) or 0)
    return configs


def test_a_config_file_gives_defaults_the_command_line_overrides(tmp_path: Path, launched):
    path = tmp_path / "run.toml"
    path.write_text(
        'seq_len = 32\n"lr-schedule" = "cosine"\nsteps = 7\nlr = 1\nresume = false\n'
        'text = "corpus.txt"\nschedule = "zbv"\nreceive_lead = "none"\n'
    )
    assert main(["train", "--config", str(path), "--steps", "9", "-s", "gpipe"]) == 0
    (config,) = launched
    assert (config.seq_len, config.lr_schedule, config.lr, config.data) == (
        32,
        "cosine",
        1.0,
        "corpus.txt",
    )
    assert (config.steps, config.schedule, config.receive_lead) == (9, "gpipe", None)
    assert config_from_argv(["--config", str(path), "--seq-len", "64"]).seq_len == 64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seq_lem = 32\n", "unknown key 'seq_lem'; did you mean 'seq_len'?"),
        ('steps = "10"\n', "steps: expected an integer, got '10'"),
        ("steps = 0\n", "steps: expected an integer >= 1, got 0"),
        ("resume = 1\n", "resume: expected true or false"),
        ('lr-schedule = "step"\n', "lr-schedule: expected one of constant, cosine, linear"),
        ("lr = [1]\n", "lr: expected a number"),
        ("seq_len = 1\nseq-len = 2\n", "sets --seq-len a second time"),
        ("worker = true\n", "unknown key 'worker'"),
        ("steps = \n", "is not TOML"),
    ],
)
def test_a_bad_config_file_exits_2_naming_the_key(tmp_path: Path, capsys, launched, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not launched
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_prefix_of_a_flag_is_not_taken_for_it(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["train", "--data-p", "2"])
    assert exit.value.code == 2 and "unrecognized arguments: --data-p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_argv(["--check", "k"])  # not --checkpoint-dir / --checkpoint-every


def test_data_takes_text_as_its_alias_and_the_new_flags_their_choices(capsys) -> None:
    assert config_from_argv(["--text", "a.txt"]).data == "a.txt"
    config = config_from_argv(["--data", "b.txt", "--packing", "none", "--deterministic"])
    assert (config.data, config.text, config.packing, config.deterministic) == (
        "b.txt",
        "b.txt",
        "none",
        True,
    )
    assert config_from_argv(config.argv()) == config
    with pytest.raises(SystemExit):
        config_from_argv(["--attention", "xformers"])
    assert "invalid choice: 'xformers'" in capsys.readouterr().err
