"""dobb_bench.cost.timing (the ``timing`` command): bad input is one line, exit code 2."""
import pytest

from dobb_bench.cli import main


@pytest.mark.parametrize("argv, message", [
    (["timing", "--preset", "huge"], "unknown GPT-2 preset"),
    (["timing", "--preset", "tiny", "--layers", "5:9"], "--layers"),
    (["timing", "--preset", "tiny", "--optimizers", "sgd"], "unknown optimizer"),
    (["timing", "--preset", "tiny", "--repeats", "0"], "--repeats"),
    (["timing", "--preset", "tiny", "--device", "cpu", "--fs", "2"], "torchrun"),
    (["timing", "--preset", "tiny", "--device", "cpu", "--threads", "0"], "--threads"),
    (["payload", "--shards", "0"], "--shards"),
    (["payload", "--optimizers", "dion:rank_fraction"], "key=value"),
    (["payload", "--optimizers", "sgd"], "unknown optimizer"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
