import pytest

from expertmesh.cli.main import main


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-command"],
        ["trace", "generate", "--steps", "many"],
        ["plan", "--bogus-flag"],
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0]
